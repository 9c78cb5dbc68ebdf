"""The small models ``docs/hooks.md`` is generated from (``workbench.hook_table``): together they exercise every
kind of hook, and every dimension has a size no other dimension has, so a cached tensor's shape names its axes.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.config import LatentAttentionConfig, MoEConfig
from workbench.model import Decoder
from workbench.options import split_saved_config

# One size per dimension name, all different, so a tensor's shape names its own axes.
# batch, pos and key_pos are set by the run below (key_pos = prefix + pos through the KV cache).
DIMENSIONS: dict[str, int] = {
    "1": 1,
    "n_key_value_heads": 2,
    "batch": 3,
    "n_heads/2": 4,  # differential attention's head pairs
    "pos": 5,
    "rotary_dim": 6,  # latent attention's shared rotary key (even and below d_head)
    "key_pos": 7,
    "n_heads": 8,
    "d_head": 10,
    "experts_per_token": 12,
    "d_head_v": 13,  # latent attention's value width per head
    "kv_lora_rank": 14,
    "q_lora_rank": 15,
    "d_model": 16,
    "d_shared_expert": 18,
    "num_experts": 21,
    "n_key_value_heads*d_head": 20,  # a QK norm over the whole key projection
    "d_mlp": 24,
    "n_heads*d_head": 80,  # ... over the whole query projection
}
PREFIX = DIMENSIONS["key_pos"] - DIMENSIONS["pos"]  # positions already in the KV cache
_D_VOCAB, _N_CTX = 11, 32  # not hook dimensions; kept apart from the sizes above anyway

_SHARED = dict(n_layers=2, d_model=DIMENSIONS["d_model"], n_heads=DIMENSIONS["n_heads"],
               n_key_value_heads=DIMENSIONS["n_key_value_heads"], d_head=DIMENSIONS["d_head"],
               d_mlp=DIMENSIONS["d_mlp"], d_vocab=_D_VOCAB, n_ctx=_N_CTX)

# The models the table is generated from. Every one but latent attention uses GQA: with
# n_key_value_heads == n_heads the K/V head axis could not be told apart from the query head axis.
# Latent attention expands keys and values for every query head (n_key_value_heads == n_heads), so
# its hook_k/hook_v axis is n_heads by construction.
_LATENT = dict(positional="rotary", normalization="RMS", gated_mlp=True, act_fn="silu",
               n_key_value_heads=DIMENSIONS["n_heads"], rotary_dim=DIMENSIONS["rotary_dim"],
               num_experts=DIMENSIONS["num_experts"], experts_per_token=DIMENSIONS["experts_per_token"])


def _latent(**latent: Any) -> LatentAttentionConfig:
    return LatentAttentionConfig(kv_lora_rank=DIMENSIONS["kv_lora_rank"], d_head_v=DIMENSIONS["d_head_v"], **latent)


def _deepseek_router(**moe: Any) -> MoEConfig:
    return MoEConfig(router_groups=3, router_topk_groups=2, d_shared_expert=DIMENSIONS["d_shared_expert"], **moe)


_MOE = dict(positional="rotary", normalization="RMS", gated_mlp=True, act_fn="silu",
            num_experts=DIMENSIONS["num_experts"], experts_per_token=DIMENSIONS["experts_per_token"])
_DENSE_FIRST_LAYER = ({"num_experts": 0, "experts_per_token": 0}, {})

REFERENCE_CONFIGS: dict[str, dict] = {
    "learned positions, LayerNorm, biases": dict(
        positional="learned", normalization="LN", attn_bias=True, mlp_bias=True, act_fn="gelu"),
    "rotary, RMSNorm, gated MLP": dict(
        positional="rotary", normalization="RMS", gated_mlp=True, act_fn="silu"),
    "mixture of experts": dict(_MOE),
    "attention-only": dict(positional="rotary", attn_only=True),
    "sinusoidal positions, post-norm": dict(
        positional="sinusoidal", norm_placement="post", act_fn="relu"),
    "rotary, RMSNorm, gated MLP, split qkv input": dict(
        positional="rotary", normalization="RMS", gated_mlp=True, act_fn="silu", use_split_qkv_input=True),
    "sandwich norms, per-head QK norm, soft-caps (Gemma 2/3)": dict(
        positional="rotary", normalization="RMS", gated_mlp=True, act_fn="gelu_new", norm_placement="sandwich",
        qk_norm="head", attn_scores_soft_cap=50.0, output_logits_soft_cap=30.0, embed_scale=4.0),
    "norms after the sublayers, QK norm over the projection (OLMo 2)": dict(
        positional="rotary", normalization="RMS", gated_mlp=True, act_fn="silu", norm_placement="sublayer_output",
        qk_norm="projection"),
    "ALiBi, embedding norm, parallel attention and MLP (BLOOM, GPT-J)": dict(
        positional="alibi", normalization="LN", embed_norm=True, parallel_attn_mlp=True, attn_bias=True,
        mlp_bias=True, act_fn="gelu_new"),
    "latent attention with a query bottleneck, sigmoid group-limited router, shared expert, dense first "
    "layer (DeepSeek-V3)": dict(
        _LATENT, latent=_latent(q_lora_rank=DIMENSIONS["q_lora_rank"]),
        moe=_deepseek_router(router_scoring="sigmoid", router_score_correction=True, router_group_score="top2_sum",
                             routed_scaling_factor=2.5), layer_overrides=_DENSE_FIRST_LAYER),
    "latent attention, softmax group-limited router, shared expert (DeepSeek-V2)": dict(
        _LATENT, latent=_latent(), moe=_deepseek_router(router_scoring="softmax", router_group_score="max",
                                                        router_renormalize=False, routed_scaling_factor=16.0)),
    "attention sinks, top-k-then-softmax router with bias, expert biases, clamped SwiGLU (gpt-oss)": dict(
        _MOE, attn_bias=True, attn_sinks=True, layer_overrides=({"sliding_window": 4}, {}),
        moe=MoEConfig(router_scoring="topk_softmax", router_bias=True, expert_bias=True, swiglu_limit=7.0,
                      swiglu_alpha=1.702)),
    "differential attention: two softmax maps per head pair (DiffLlama)": dict(
        positional="rotary", normalization="RMS", gated_mlp=True, act_fn="silu", differential_lambda_init=0.3),
    "gated shared expert, no renormalisation (Qwen2-MoE)": dict(
        _MOE, attn_bias=True, moe=MoEConfig(router_renormalize=False, d_shared_expert=DIMENSIONS["d_shared_expert"],
                                            shared_expert_gate=True)),
}


def reference_models() -> dict[str, Decoder]:
    """The small randomly initialised models the table is generated from, by description.

    Example:
        >>> models = reference_models()
        >>> models["mixture of experts"].cfg.num_experts
        21
    """
    torch.manual_seed(0)
    models = {}
    for label, extra in REFERENCE_CONFIGS.items():
        cfg, options = split_saved_config({**_SHARED, **extra})  # an entry may set a runtime option too
        models[label] = Decoder(cfg, **options).eval()
    return models
