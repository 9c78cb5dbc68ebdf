"""Dense MLPs: GELU/ReLU/SiLU MLP and the gated (SwiGLU / GeGLU) MLP.

Legend: B batch, P position, D d_model, M d_mlp.

``W_in`` and ``W_gate`` [D, M], ``W_out`` [M, D] are TransformerLens's names, shapes and meaning;
they are views of the weights stored in `torch.nn.Linear`'s layout under private names
(``_W_in_lin``/``_W_gate_lin`` [M, D], ``_W_out_lin`` [D, M]), which feed ``F.linear`` as
`transformers` does. ``b_in``, ``b_gate`` [M] and ``b_out`` [D] are stored as they are.
Hooks follow TransformerLens: ``hook_pre`` is the pre-activation (the gate's, for a gated MLP),
``hook_pre_linear`` the gated MLP's linear branch, ``hook_post`` the input to ``W_out``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from workbench.config import ModelConfig
from workbench.options import RuntimeOptions
from workbench.components.zero_biases import ZeroBiases
from workbench.hook_point import HookPoint

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's tanh approximation
    "silu": F.silu,
    "relu": F.relu,
}


class DenseWeights:
    """TransformerLens's ``W_in`` [D, M] and ``W_out`` [M, D]: views of the nn.Linear-layout storage."""

    @property
    def W_in(self) -> Float[Tensor, "d_model d_mlp"]:
        return self._W_in_lin.T

    @property
    def W_out(self) -> Float[Tensor, "d_mlp d_model"]:
        return self._W_out_lin.T


class MLP(DenseWeights, ZeroBiases, nn.Module):
    """out = W_out act(W_in x + b_in) + b_out."""

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__()
        self.bias_shapes = {"b_in": (cfg.d_mlp,), "b_out": (cfg.d_model,)}  # TransformerLens's; absent: zeros
        self.act = ACTIVATIONS[cfg.act_fn]
        self._W_in_lin = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model, dtype=options.dtype))
        self._W_out_lin = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp, dtype=options.dtype))
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp, dtype=options.dtype)) if cfg.mlp_bias else None
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model, dtype=options.dtype)) if cfg.mlp_bias else None
        self.hook_pre = HookPoint()  # [B, P, M]
        self.hook_post = HookPoint()  # [B, P, M]

    def forward(self, x_BPD: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        pre_BPM = self.hook_pre(F.linear(x_BPD, self._W_in_lin, self.stored_bias("b_in")))
        post_BPM = self.hook_post(self.act(pre_BPM))
        return F.linear(post_BPM, self._W_out_lin, self.stored_bias("b_out"))


class GatedMLP(DenseWeights, ZeroBiases, nn.Module):
    """out = W_out (act(W_gate x) * (W_in x)): SwiGLU with silu, GeGLU with gelu."""

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__()
        self.bias_shapes = {"b_in": (cfg.d_mlp,), "b_out": (cfg.d_model,)}  # TransformerLens's; absent: zeros
        self.act = ACTIVATIONS[cfg.act_fn]
        self._W_gate_lin = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model, dtype=options.dtype))
        self._W_in_lin = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model, dtype=options.dtype))
        self._W_out_lin = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp, dtype=options.dtype))
        self.b_gate = nn.Parameter(torch.zeros(cfg.d_mlp, dtype=options.dtype)) if cfg.mlp_bias else None
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp, dtype=options.dtype)) if cfg.mlp_bias else None
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model, dtype=options.dtype)) if cfg.mlp_bias else None
        self.hook_pre = HookPoint()  # [B, P, M] gate pre-activation
        self.hook_pre_linear = HookPoint()  # [B, P, M]
        self.hook_post = HookPoint()  # [B, P, M]

    def forward(self, x_BPD: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        pre_BPM = self.hook_pre(F.linear(x_BPD, self._W_gate_lin, self.b_gate))
        pre_linear_BPM = self.hook_pre_linear(F.linear(x_BPD, self._W_in_lin, self.stored_bias("b_in")))
        post_BPM = self.hook_post(self.act(pre_BPM) * pre_linear_BPM)
        return F.linear(post_BPM, self._W_out_lin, self.stored_bias("b_out"))

    @property
    def W_gate(self) -> Float[Tensor, "d_model d_mlp"]:
        return self._W_gate_lin.T
