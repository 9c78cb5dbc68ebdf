"""Top-k mixture of experts with router hooks: Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3 and gpt-oss routers,
shared experts and gpt-oss's clamped SwiGLU, all as config values.

Legend: B batch, P position, N flattened tokens, D d_model, M d_mlp, E num_experts, k experts_per_token.

M is one expert's width.

The router is a linear map ``W_router`` [D, E] (plus ``b_router`` [E] with ``router_bias``). Its logits
become chosen experts and weights by ``router_scoring`` (``ModelConfig``; ``RoutingRule``):

    softmax       p = softmax(logits) over all experts; the top k of p (Mixtral, Qwen2/3-MoE, DeepSeek-V2)
    sigmoid       p = sigmoid(logits); the top k of p + correction bias (DeepSeek-V3)
    topk_softmax  the top k of the logits; p = softmax over those k only (gpt-oss, GraniteMoE)
    topk_sigmoid  the top k of the logits; p = their sigmoids (Llama 4)
    sparsemixer   Phi-3.5-MoE's top 2: the best expert, weighted by the softmax of the logits within a
                  relative 2 * router_jitter_eps of the best; then the best of the others, weighted the same
                  way over the logits without the first

With ``router_groups`` the experts form equal groups and only the ``router_topk_groups`` best groups
(a group's score: its best expert's, or its best two summed) may be chosen. The correction bias
(``router_score_correction`` [E], DeepSeek-V3's ``e_score_correction_bias``) only picks experts; the
weights are the chosen experts' p, rescaled to sum to one with ``router_renormalize`` (not for
topk_softmax and sparsemixer, whose weights are their own) and multiplied by ``routed_scaling_factor``.
The renormalising sum has 1e-20 added, or is clamped below at ``router_renormalize_floor`` (ERNIE 4.5).

Experts are gated MLPs (or plain ones without ``gated_mlp``) whose weights are stacked: ``W_gate``/``W_in``
[E, D, M], ``W_out`` [E, M, D], each expert in TransformerLens's dense-MLP layout, views of the
nn.Linear-layout storage (``_W_router_lin`` [E, D], ``_W_gate_lin``/``_W_in_lin`` [E, M, D],
``_W_out_lin`` [E, D, M]); ``b_gate``/``b_in`` [E, M] and ``b_out`` [E, D] with ``expert_bias``.
With ``swiglu_limit`` (gpt-oss) an expert computes (clamp(up) + 1) * g * sigmoid(alpha * g) with
g = min(gate, limit). Tokens are grouped by expert and each expert runs once on its tokens: the Python
loop is over the experts that received tokens, never over tokens.

With ``router_weights_input`` (Llama 4) the weight scales the expert's input instead: expert(w * x).

A shared expert (``d_shared_expert``) is a gated MLP every token runs (``shared``), its output
optionally scaled by sigmoid(``W_shared_gate`` x) (Qwen2-MoE); it is added to the routed output.

Hooks: ``hook_router_logits`` [B, P, E] (the linear map's output, before any scoring, correction
bias or group mask; editing it changes which experts run); ``hook_expert_indices`` [B, P, k];
``hook_expert_weights`` [B, P, k] (zeroing one ablates that expert); ``hook_shared_out`` [B, P, D]
(the shared expert's contribution, gate included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from workbench.components.mlp import ACTIVATIONS, GatedMLP
from workbench.config import ModelConfig
from workbench.options import RuntimeOptions
from workbench.hook_point import HookPoint

RENORMALIZE_EPS = 1e-20  # DeepSeek-V3's guard in the renormalising sum (no effect on any other router)


@dataclass(frozen=True)
class RoutingRule:
    """How router logits become chosen experts and their weights (the ``router_*`` config values)."""

    k: int
    scoring: str = "softmax"
    renormalize: bool = True
    groups: Optional[int] = None
    topk_groups: Optional[int] = None
    group_score: str = "max"
    scaling_factor: float = 1.0
    renormalize_floor: Optional[float] = None
    jitter_eps: float = 0.0

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "RoutingRule":
        return cls(cfg.experts_per_token, cfg.moe.router_scoring, cfg.moe.router_renormalize, cfg.moe.router_groups,
                   cfg.moe.router_topk_groups, cfg.moe.router_group_score, cfg.moe.routed_scaling_factor,
                   cfg.moe.router_renormalize_floor, cfg.moe.router_jitter_eps)

    def choose(self, logits_BPE: Float[Tensor, "batch pos num_experts"], correction_E: Optional[Tensor] = None
               ) -> tuple[Int[Tensor, "batch pos k"], Float[Tensor, "batch pos k"]]:
        """The chosen experts and their weights (float32) for router logits.

        Example:
            >>> rule = RoutingRule(k=1)
            >>> rule.choose(torch.tensor([[[0.0, 2.0, 1.0]]]))[0].tolist()
            [[[1]]]
        """
        logits_BPE = logits_BPE.float()
        if self.scoring == "topk_softmax":
            top_logits_BPk, indices_BPk = torch.topk(logits_BPE, self.k, dim=-1)
            return indices_BPk, torch.softmax(top_logits_BPk, dim=-1) * self.scaling_factor
        if self.scoring == "topk_sigmoid":
            top_logits_BPk, indices_BPk = torch.topk(logits_BPE, self.k, dim=-1)
            return indices_BPk, torch.sigmoid(top_logits_BPk) * self.scaling_factor
        if self.scoring == "sparsemixer":
            indices_BPk, weights_BPk = self._sparsemixer(logits_BPE)
            return indices_BPk, weights_BPk * self.scaling_factor
        scores_BPE = self.scores(logits_BPE)
        choice_BPE = scores_BPE if correction_E is None else scores_BPE + correction_E.float()
        if self.groups is not None:
            choice_BPE = self._mask_groups(choice_BPE)
        indices_BPk = torch.topk(choice_BPE, self.k, dim=-1).indices
        weights_BPk = scores_BPE.gather(-1, indices_BPk)
        if self.renormalize:
            total_BP1 = weights_BPk.sum(dim=-1, keepdim=True)
            total_BP1 = total_BP1 + RENORMALIZE_EPS if self.renormalize_floor is None else total_BP1.clamp(
                min=self.renormalize_floor)
            weights_BPk = weights_BPk / total_BP1
        return indices_BPk, weights_BPk * self.scaling_factor

    def _sparsemixer(self, logits_BPE: Tensor) -> tuple[Tensor, Tensor]:
        """Phi-3.5-MoE's inference routing (transformers' ``sparsemixer`` outside training): two rounds, each
        choosing the best remaining expert and weighting it by a softmax over the logits that are within a
        relative ``2 * jitter_eps`` of that best one (the first round's expert masked out of the second)."""
        remaining_BPE, indices, weights = logits_BPE, [], []
        for _ in range(2):
            best_BP1, index_BP1 = remaining_BPE.max(dim=-1, keepdim=True)
            factor_BPE = logits_BPE.abs().clamp(min=best_BP1)
            far_BPE = (best_BP1 - logits_BPE) / factor_BPE > 2 * self.jitter_eps
            gates_BPE = torch.softmax(remaining_BPE.masked_fill(far_BPE, float("-inf")), dim=-1)
            indices.append(index_BP1)
            weights.append(gates_BPE.gather(-1, index_BP1))
            remaining_BPE = remaining_BPE.scatter(-1, index_BP1, float("-inf"))
        return torch.cat(indices, dim=-1), torch.cat(weights, dim=-1)

    def scores(self, logits_BPE: Float[Tensor, "batch pos num_experts"]) -> Float[Tensor, "batch pos num_experts"]:
        """Every expert's score (float32), as the router scores them: the sigmoid of the logits for a sigmoid
        router, else their softmax over all experts (a topk_softmax router's choice follows the same order).

        Example:
            >>> RoutingRule(k=1).scores(torch.tensor([[[0.0, 0.0]]])).tolist()
            [[[0.5, 0.5]]]
            >>> RoutingRule(k=1, scoring="sigmoid").scores(torch.tensor([[[0.0, 0.0]]])).tolist()
            [[[0.5, 0.5]]]
        """
        logits_BPE = logits_BPE.float()
        return torch.sigmoid(logits_BPE) if self.scoring == "sigmoid" else torch.softmax(logits_BPE, dim=-1)

    def probabilities(self, logits_BPE: Float[Tensor, "batch pos num_experts"]
                      ) -> Float[Tensor, "batch pos num_experts"]:
        """The router's distribution over all experts (float32): ``scores``, which sum to one but for a
        sigmoid router, whose scores are normalised to sum to one. A correction bias or group mask, which
        only pick the experts, is no part of it.

        Example:
            >>> RoutingRule(k=1, scoring="sigmoid").probabilities(torch.tensor([[[0.0, 0.0, 0.0, 0.0]]])).tolist()
            [[[0.25, 0.25, 0.25, 0.25]]]
        """
        scores_BPE = self.scores(logits_BPE)
        if self.scoring == "sigmoid":
            return scores_BPE / scores_BPE.sum(-1, keepdim=True)
        return scores_BPE

    def _mask_groups(self, choice_BPE: Tensor) -> Tensor:
        """Scores outside the ``topk_groups`` best groups set to -inf, so no expert there is chosen."""
        grouped_BPGe = choice_BPE.unflatten(-1, (self.groups, -1))
        if self.group_score == "max":
            group_scores_BPG = grouped_BPGe.amax(dim=-1)
        else:  # top2_sum
            group_scores_BPG = grouped_BPGe.topk(2, dim=-1).values.sum(dim=-1)
        best_BPg = group_scores_BPG.topk(self.topk_groups, dim=-1).indices
        keep_BPG = torch.zeros_like(group_scores_BPG, dtype=torch.bool).scatter_(-1, best_BPg, True)
        return grouped_BPGe.masked_fill(~keep_BPG[..., None], float("-inf")).flatten(-2)


class MixtureOfExperts(nn.Module):
    """out[t] = sum over chosen experts e of weight[t, e] * expert_e(x[t])  (+ shared(x[t]))."""

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__()
        E, M, D = cfg.num_experts, cfg.d_mlp, cfg.d_model
        self.routing = RoutingRule.from_config(cfg)
        self._W_router_lin = nn.Parameter(torch.empty(E, D, dtype=options.dtype))
        self.b_router = nn.Parameter(torch.zeros(E, dtype=options.dtype)) if cfg.moe.router_bias else None
        self.router_in_float32 = cfg.moe.router_in_float32
        self.weights_scale_input = cfg.moe.router_weights_input
        # Always float32, as transformers keeps e_score_correction_bias: in bfloat16 its rounding alone
        # would change which experts close scores pick (``_apply`` keeps it so through ``.to()``).
        self.router_score_correction = (nn.Parameter(torch.zeros(E, dtype=torch.float32))
                                        if cfg.moe.router_score_correction else None)
        self.act = ACTIVATIONS[cfg.act_fn]
        self.swiglu_limit, self.swiglu_alpha = cfg.moe.swiglu_limit, cfg.moe.swiglu_alpha
        self._W_gate_lin = nn.Parameter(torch.empty(E, M, D, dtype=options.dtype)) if cfg.gated_mlp else None
        self._W_in_lin = nn.Parameter(torch.empty(E, M, D, dtype=options.dtype))
        self._W_out_lin = nn.Parameter(torch.empty(E, D, M, dtype=options.dtype))
        bias = (lambda *shape: nn.Parameter(torch.zeros(*shape, dtype=options.dtype))) if cfg.moe.expert_bias else (lambda *_: None)
        self.b_gate = bias(E, M) if cfg.gated_mlp else None
        self.b_in, self.b_out = bias(E, M), bias(E, D)
        if cfg.moe.d_shared_expert:
            self.shared = GatedMLP(cfg.replace(d_mlp=cfg.moe.d_shared_expert, num_experts=0, experts_per_token=0,
                                               layer_overrides=()), options)
            self._W_shared_gate_lin = (nn.Parameter(torch.empty(1, D, dtype=options.dtype))
                                       if cfg.moe.shared_expert_gate else None)
        else:
            self.shared, self._W_shared_gate_lin = None, None
        self.hook_router_logits = HookPoint()  # [B, P, E]
        self.hook_expert_weights = HookPoint()  # [B, P, k]
        self.hook_expert_indices = HookPoint()  # [B, P, k]
        if self.shared is not None:
            self.hook_shared_out = HookPoint()  # [B, P, D]

    def forward(self, x_BPD: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        B, P, D = x_BPD.shape
        logits_BPE = self.hook_router_logits(self.router_logits(x_BPD))
        indices_BPk, weights_BPk = self.routing.choose(logits_BPE, self.router_score_correction)
        weights_BPk = self.hook_expert_weights(weights_BPk.to(x_BPD.dtype))
        indices_BPk = self.hook_expert_indices(indices_BPk)

        x_ND = x_BPD.reshape(B * P, D)
        weights_Nk, indices_Nk = weights_BPk.reshape(B * P, -1), indices_BPk.reshape(B * P, -1)
        out_ND = torch.zeros_like(x_ND)
        # On the meta device (wb.plan_memory) the routing has no values and only shapes matter: no expert runs.
        for expert in ([] if x_ND.is_meta else indices_Nk.unique().tolist()):
            token_idx, slot_idx = torch.where(indices_Nk == expert)
            weight_N1 = weights_Nk[token_idx, slot_idx, None]
            if self.weights_scale_input:  # Llama 4: expert(w * x)
                out_ND.index_add_(0, token_idx, self.expert_forward(expert, x_ND[token_idx] * weight_N1))
            else:
                out_ND.index_add_(0, token_idx, self.expert_forward(expert, x_ND[token_idx]) * weight_N1)
        out_BPD = out_ND.view(B, P, D)
        if self.shared is None:
            return out_BPD
        shared_BPD = self.shared(x_BPD)
        if self._W_shared_gate_lin is not None:
            shared_BPD = torch.sigmoid(F.linear(x_BPD, self._W_shared_gate_lin)) * shared_BPD
        return out_BPD + self.hook_shared_out(shared_BPD)

    def router_logits(self, x_BPD: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos num_experts"]:
        """The router's linear map (in float32 with ``router_in_float32``, as DeepSeek's runs).

        Example:
            >>> moe = MixtureOfExperts(ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4, d_mlp=6,
            ...                                    num_experts=4, experts_per_token=2, gated_mlp=True, act_fn="silu"),
            ...                        RuntimeOptions())
            >>> moe.router_logits(torch.zeros(1, 3, 8)).shape   # [batch, pos, num_experts]
            torch.Size([1, 3, 4])
        """
        if not self.router_in_float32:
            return F.linear(x_BPD, self._W_router_lin, self.b_router)
        bias = None if self.b_router is None else self.b_router.float()
        return F.linear(x_BPD.float(), self._W_router_lin.float(), bias)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        if self.router_score_correction is not None and self.router_score_correction.dtype != torch.float32:
            self.router_score_correction.data = self.router_score_correction.data.float()
        return self

    def expert_forward(self, expert: int, x_ND: Float[Tensor, "tokens d_model"]) -> Float[Tensor, "tokens d_model"]:
        """One expert's MLP on the tokens routed to it (unweighted): ``expert_hidden`` through its W_out.

        Example:
            >>> moe = MixtureOfExperts(ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4, d_mlp=6,
            ...                                    num_experts=4, experts_per_token=2, gated_mlp=True, act_fn="silu"),
            ...                        RuntimeOptions())
            >>> moe.expert_forward(3, torch.zeros(5, 8)).shape   # what expert 3 adds, before its router weight
            torch.Size([5, 8])
        """
        return F.linear(self.expert_hidden(expert, x_ND), self._W_out_lin[expert], _row(self.b_out, expert))

    def expert_hidden(self, expert: int, x_ND: Float[Tensor, "tokens d_model"]) -> Float[Tensor, "tokens d_mlp"]:
        """One expert's hidden activations on ``x_ND`` (its MLP inputs): its input to W_out, the one
        implementation of the expert's first half (the forward and ``Decoder.expert_hidden`` both call it).

        act(x W_in + b_in) for a plain expert, act(x W_gate + b_gate) * (x W_in + b_in) for a gated one,
        gpt-oss's clamped SwiGLU with ``swiglu_limit``.

        Example:
            >>> moe = MixtureOfExperts(ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4, d_mlp=6,
            ...                                    num_experts=4, experts_per_token=2, gated_mlp=True, act_fn="silu"),
            ...                        RuntimeOptions())
            >>> moe.expert_hidden(3, torch.zeros(5, 8)).shape
            torch.Size([5, 6])
        """
        hidden_NM = F.linear(x_ND, self._W_in_lin[expert], _row(self.b_in, expert))
        if self._W_gate_lin is None:
            return self.act(hidden_NM)
        gate_NM = F.linear(x_ND, self._W_gate_lin[expert], _row(self.b_gate, expert))
        return self._gated(gate_NM, hidden_NM)

    def _gated(self, gate_NM: Tensor, up_NM: Tensor) -> Tensor:
        if self.swiglu_limit is None:
            return self.act(gate_NM) * up_NM
        limit = self.swiglu_limit
        gate_NM, up_NM = gate_NM.clamp(max=limit), up_NM.clamp(-limit, limit)
        return (up_NM + 1) * gate_NM * torch.sigmoid(gate_NM * self.swiglu_alpha)

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


def _row(bias: Optional[Tensor], expert: int) -> Optional[Tensor]:
    return None if bias is None else bias[expert]

