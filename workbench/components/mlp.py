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
from workbench.hook_point import HookPoint, has_forward_hooks

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's tanh approximation
    "silu": F.silu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (Nemotron, Arcee)
}


class XIELU(nn.Module):
    """xIELU (Apertus; arXiv 2411.13010), with this layer's learned scalars as transformers stores them:
    ``alpha_p``, ``alpha_n`` [1] (through softplus) and ``beta``, ``eps`` [] (fixed there, read here).

        x > 0:  softplus(alpha_p) x^2 + beta x
        else:   (expm1(min(x, eps)) - x) (beta + softplus(alpha_n)) + beta x

    Example:
        >>> act = XIELU(RuntimeOptions())
        >>> act(torch.tensor([2.0, 0.0])).tolist()   # every scalar 0: softplus(0) x^2 = log(2) * 4
        [2.7725887298583984, 0.0]
    """

    def __init__(self, options: RuntimeOptions):
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1, dtype=options.dtype))
        self.alpha_n = nn.Parameter(torch.zeros(1, dtype=options.dtype))
        self.beta = nn.Parameter(torch.zeros((), dtype=options.dtype))
        self.eps = nn.Parameter(torch.zeros((), dtype=options.dtype))

    def forward(self, x: Tensor) -> Tensor:
        alpha_p, alpha_n = F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)


def make_activation(cfg: ModelConfig, options: RuntimeOptions) -> Callable[[Tensor], Tensor]:
    """``cfg.act_fn`` as a function, or as a module holding its own parameters (xIELU).

    Example:
        >>> make_activation(model.config.replace(act_fn="relu2"), model.options)(torch.tensor([-1.0, 3.0])).tolist()
        [0.0, 9.0]
    """
    return XIELU(options) if cfg.act_fn == "xielu" else ACTIVATIONS[cfg.act_fn]


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
        self.act = make_activation(cfg, options)
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
        gate_BPM = self.act(pre_BPM)  # a new tensor under every activation
        # Without autograd, and with no torch hook holding the activation's output, the product goes into that
        # tensor: one [B, P, M] allocation fewer (a SmolLM2 head sweep spends ~2% of its time here).
        in_place = not (torch.is_grad_enabled() or has_forward_hooks(self.act))
        post_BPM = self.hook_post(gate_BPM.mul_(pre_linear_BPM) if in_place else gate_BPM * pre_linear_BPM)
        return F.linear(post_BPM, self._W_out_lin, self.stored_bias("b_out"))

    @property
    def W_gate(self) -> Float[Tensor, "d_model d_mlp"]:
        return self._W_gate_lin.T
