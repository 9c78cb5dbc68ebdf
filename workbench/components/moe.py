"""Top-k mixture of experts (Mixtral-style) with router hooks.

Legend: B batch, P position, N flattened tokens, D d_model, M d_mlp, E num_experts,
k experts_per_token.

The router is a linear map ``W_router`` [D, E]; its softmax is taken over all experts, the top
k kept and (with ``cfg.router_renormalize``) rescaled to sum to one. Experts are gated or plain
MLPs whose weights are stacked: ``W_gate``/``W_in`` [E, D, M], ``W_out`` [E, M, D], each
expert in TransformerLens's dense-MLP layout. These are views of the nn.Linear-layout storage
(``_W_router_lin`` [E, D], ``_W_gate_lin``/``_W_in_lin`` [E, M, D], ``_W_out_lin`` [E, D, M]). Tokens are
grouped by expert and each expert runs once on its tokens: the Python loop is over the E
experts, never over tokens.

Hooks: ``hook_router_logits`` [B, P, E]; ``hook_expert_weights`` [B, P, k] (editing them,
e.g. zeroing one expert's weight, ablates that expert); ``hook_expert_indices`` [B, P, k].
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from workbench.components.mlp import ACTIVATIONS
from workbench.config import ModelConfig


class MixtureOfExperts(nn.Module):
    """out[t] = sum over chosen experts e of weight[t, e] * expert_e(x[t])."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, M, D = cfg.num_experts, cfg.d_mlp, cfg.d_model
        self.experts_per_token, self.renormalize = cfg.experts_per_token, cfg.router_renormalize
        self.act = ACTIVATIONS[cfg.act_fn]
        self._W_router_lin = nn.Parameter(torch.empty(E, D, dtype=cfg.dtype))
        self._W_gate_lin = nn.Parameter(torch.empty(E, M, D, dtype=cfg.dtype)) if cfg.gated_mlp else None
        self._W_in_lin = nn.Parameter(torch.empty(E, M, D, dtype=cfg.dtype))
        self._W_out_lin = nn.Parameter(torch.empty(E, D, M, dtype=cfg.dtype))
        self.hook_router_logits = HookPoint()  # [B, P, E]
        self.hook_expert_weights = HookPoint()  # [B, P, k]
        self.hook_expert_indices = HookPoint()  # [B, P, k]

    def forward(self, x_BPD: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        B, P, D = x_BPD.shape
        logits_BPE = self.hook_router_logits(F.linear(x_BPD, self._W_router_lin))
        probs_BPE = torch.softmax(logits_BPE.float(), dim=-1)
        weights_BPk, indices_BPk = torch.topk(probs_BPE, self.experts_per_token, dim=-1)
        if self.renormalize:
            weights_BPk = weights_BPk / weights_BPk.sum(dim=-1, keepdim=True)
        weights_BPk = self.hook_expert_weights(weights_BPk.to(x_BPD.dtype))
        indices_BPk = self.hook_expert_indices(indices_BPk)

        x_ND = x_BPD.reshape(B * P, D)
        weights_Nk, indices_Nk = weights_BPk.reshape(B * P, -1), indices_BPk.reshape(B * P, -1)
        out_ND = torch.zeros_like(x_ND)
        for expert in indices_Nk.unique().tolist():
            token_idx, slot_idx = torch.where(indices_Nk == expert)
            y = self.expert_forward(expert, x_ND[token_idx])
            out_ND.index_add_(0, token_idx, y * weights_Nk[token_idx, slot_idx, None])
        return out_ND.view(B, P, D)

    def expert_forward(self, expert: int, x_ND: Float[Tensor, "tokens d_model"]) -> Float[Tensor, "tokens d_model"]:
        """One expert's MLP on the tokens routed to it."""
        hidden_NM = F.linear(x_ND, self._W_in_lin[expert])
        if self._W_gate_lin is not None:
            hidden_NM = self.act(F.linear(x_ND, self._W_gate_lin[expert])) * hidden_NM
        else:
            hidden_NM = self.act(hidden_NM)
        return F.linear(hidden_NM, self._W_out_lin[expert])

    # ---- TransformerLens-layout views ----------------------------------------------------------
    @property
    def W_router(self) -> Float[Tensor, "d_model num_experts"]:
        return self._W_router_lin.T

    @property
    def W_in(self) -> Float[Tensor, "num_experts d_model d_mlp"]:
        return self._W_in_lin.transpose(1, 2)

    @property
    def W_gate(self) -> Optional[Float[Tensor, "num_experts d_model d_mlp"]]:
        return None if self._W_gate_lin is None else self._W_gate_lin.transpose(1, 2)

    @property
    def W_out(self) -> Float[Tensor, "num_experts d_mlp d_model"]:
        return self._W_out_lin.transpose(1, 2)
