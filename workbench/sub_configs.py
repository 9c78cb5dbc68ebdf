"""The parts of a ``ModelConfig`` that are configs of their own: ``MoEConfig`` (how a mixture of experts routes
and what its experts compute, ``cfg.moe``) and ``LatentAttentionConfig`` (DeepSeek's multi-head latent
attention, ``cfg.latent``). Each checks its own values; what must agree with the rest of the architecture
(groups dividing the expert count, latent attention's positions) ``ModelConfig`` checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, get_args

from workbench.errors import ConfigError

# How a router turns its logits into chosen experts and their weights (``components.moe``):
# softmax: softmax over all experts, top-k of the probabilities (Mixtral, Qwen2/3-MoE, DeepSeek-V2);
# sigmoid: a sigmoid per expert, top-k of the scores plus a correction bias (DeepSeek-V3);
# topk_softmax: top-k of the logits, then a softmax over the chosen only (gpt-oss, GraniteMoE);
# sparsemixer: Phi-3.5-MoE's top-2 at inference: the best expert, weighted by a softmax over the logits
# within router_jitter_eps (relative) of it, then the best other expert, the same way over the rest.
# topk_sigmoid: top-k of the logits, each weighted by its sigmoid (Llama 4).
RouterScoring = Literal["softmax", "sigmoid", "topk_softmax", "sparsemixer", "topk_sigmoid"]
# The score of a group of experts under group-limited routing: its best expert's (DeepSeek-V2) or the
# sum of its best two (DeepSeek-V3).
RouterGroupScore = Literal["max", "top2_sum"]


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """How a mixture of experts routes tokens and what its experts compute (``ModelConfig.moe``).

    Example:
        >>> MoEConfig(router_scoring="sigmoid", router_groups=4, router_topk_groups=2).router_groups
        4
    """

    router_renormalize: bool = True  # rescale the top-k router weights to sum to one (Mixtral)
    router_scoring: RouterScoring = "softmax"
    router_bias: bool = False  # the router's linear map has a bias (gpt-oss); it is part of the logits
    router_in_float32: bool = False  # the router's linear map runs in float32 whatever the weights' dtype (DeepSeek)
    # A per-expert bias added to the scores only to choose experts, never to weight them (DeepSeek-V3's
    # e_score_correction_bias).
    router_score_correction: bool = False
    # Group-limited routing: experts in router_groups equal groups, only the best router_topk_groups
    # groups (by router_group_score) may be chosen. None: no groups.
    router_groups: Optional[int] = None
    router_topk_groups: Optional[int] = None
    router_group_score: RouterGroupScore = "max"
    routed_scaling_factor: float = 1.0  # the chosen experts' weights are multiplied by this (DeepSeek)
    d_shared_expert: int = 0  # width of an always-on gated MLP beside the routed experts; 0: none
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(w . x) (Qwen2-MoE)
    expert_bias: bool = False  # the routed experts' projections have biases (gpt-oss)
    # gpt-oss's clamped SwiGLU in the experts: gate <= limit, -limit <= up <= limit, and
    # out = (up + 1) * gate * sigmoid(swiglu_alpha * gate). None: the plain gated MLP.
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.0
    # ---- the Llama-like mixtures of experts (OLMoE, ERNIE 4.5 MoE, Phi-3.5-MoE, Llama 4 ...) ----
    # The renormalising sum clamped below at this value instead of adding a tiny epsilon (ERNIE 4.5's
    # moe_norm_min); None: the sum plus 1e-20.
    router_renormalize_floor: Optional[float] = None
    # sparsemixer's threshold: logits further than 2 * router_jitter_eps (relative) below the best one are
    # masked out of its softmax (Phi-3.5-MoE's router_jitter_noise).
    router_jitter_eps: float = 0.0
    # The chosen expert's weight scales its input instead of its output: expert(w * x) (Llama 4).
    router_weights_input: bool = False

    def __post_init__(self) -> None:
        for name, choices in (("router_scoring", get_args(RouterScoring)), ("router_group_score", get_args(RouterGroupScore))):
            require(getattr(self, name) in choices, f"moe.{name}", f"must be one of {choices}, got {getattr(self, name)!r}")
        require(self.d_shared_expert >= 0, "moe.d_shared_expert", f"must be >= 0, got {self.d_shared_expert}")
        require(self.routed_scaling_factor > 0, "moe.routed_scaling_factor",
                f"must be positive, got {self.routed_scaling_factor}")
        require(self.router_renormalize_floor is None or self.router_renormalize_floor > 0,
                "moe.router_renormalize_floor", f"must be positive or None, got {self.router_renormalize_floor!r}")
        require(self.router_jitter_eps >= 0, "moe.router_jitter_eps", f"must be >= 0, got {self.router_jitter_eps}")
        require(self.swiglu_limit is None or self.swiglu_limit > 0, "moe.swiglu_limit",
                f"must be positive or None, got {self.swiglu_limit!r}")
        if self.router_groups is None:
            require(self.router_topk_groups is None, "moe.router_topk_groups",
                    f"is {self.router_topk_groups} but router_groups is None (no group-limited routing)")
            return
        require(self.router_groups > 0, "moe.router_groups", f"must be positive or None, got {self.router_groups}")
        require(self.router_topk_groups is not None and 0 < self.router_topk_groups <= self.router_groups,
                "moe.router_topk_groups",
                f"must be in 1..router_groups={self.router_groups}, got {self.router_topk_groups}")


@dataclass(frozen=True, kw_only=True)
class LatentAttentionConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values are expanded per head from a cached
    latent [kv_lora_rank] (normed), and one rotary key [rotary_dim] is shared by every head. The model's
    d_head is then the query/key width per head (its last rotary_dim dimensions carry RoPE, the rest none);
    d_head_v the value width. q_lora_rank: queries through a normed low-rank bottleneck too (None: one
    projection). latent_norm_eps: those two norms' eps (``ModelConfig.latent``).

    Example:
        >>> LatentAttentionConfig(kv_lora_rank=16, d_head_v=8).q_lora_rank is None
        True
    """

    kv_lora_rank: int
    q_lora_rank: Optional[int] = None
    d_head_v: Optional[int] = None  # None: the model's d_head
    latent_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        require(isinstance(self.kv_lora_rank, int) and self.kv_lora_rank > 0, "latent.kv_lora_rank",
                f"must be a positive integer, got {self.kv_lora_rank!r}")
        require(self.q_lora_rank is None or self.q_lora_rank > 0, "latent.q_lora_rank",
                f"must be positive or None, got {self.q_lora_rank}")
        require(self.d_head_v is None or self.d_head_v > 0, "latent.d_head_v",
                f"must be positive or None, got {self.d_head_v}")
        require(self.latent_norm_eps > 0, "latent.latent_norm_eps", f"must be positive, got {self.latent_norm_eps}")


# The sub-configs' fields, which configs saved before they were apart held at the top level.
SUB_CONFIGS = {"moe": MoEConfig, "latent": LatentAttentionConfig}


def require(ok: bool, field: str, message: str) -> None:
    """A ``ConfigError`` naming ``ModelConfig.<field>`` unless ``ok``.

    Example:
        >>> require(False, "moe.router_groups", "must be positive")
        Traceback (most recent call last):
        ...
        workbench.errors.ConfigError: ModelConfig.moe.router_groups must be positive
    """
    if not ok:
        raise ConfigError(f"ModelConfig.{field} {message}")
