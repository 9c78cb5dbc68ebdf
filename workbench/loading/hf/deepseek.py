"""DeepSeek-V2 and DeepSeek-V3 in HF format: multi-head latent attention and routed plus shared experts.

Legend: H n_heads, K d_head, R rotary_dim, J d_head_v, A kv_lora_rank, Q q_lora_rank, U d_head - rotary_dim,
D d_model, M d_mlp, E num_experts, V d_vocab.

What the config values mean (read off transformers 5.23's ``modeling_deepseek_v2/v3.py``):

    attention   d_head = qk_nope_head_dim + qk_rope_head_dim, rotary_dim = qk_rope_head_dim,
                d_head_v = v_head_dim, kv_lora_rank, q_lora_rank (null: one q_proj); RoPE over rotary_dim
                with rope_parameters; V2 rotates adjacent pairs (complex multiplication), V3 adjacent pairs
                with rope_interleave (the default) and halves without; the scores' scale is
                1/sqrt(d_head) times mscale(factor, mscale_all_dim)^2 when RoPE is scaled. The latent
                norms' eps is RMSNorm's default 1e-6, whatever rms_norm_eps says.
    routing     V2: softmax over the experts, top-k ("greedy") or within the topk_group best of n_group
                groups by their best expert ("group_limited_greedy"); never renormalised. V3: sigmoid
                scores plus e_score_correction_bias to choose, groups scored by their best two, weights
                renormalised with norm_topk_prob. Both scale the weights by routed_scaling_factor.
    layers      the first first_k_dense_replace layers are dense (intermediate_size); the others have
                n_routed_experts experts of moe_intermediate_size and one shared gated MLP of
                moe_intermediate_size * n_shared_experts.

HF tensor names -> ours:

    self_attn.q_proj | q_a_proj (+bias), q_a_layernorm, q_b_proj
                         -> attn._W_Q_lin | _W_QA_lin (_b_QA_lin), q_a_norm.w, _W_QB_lin
    self_attn.kv_a_proj_with_mqa (+bias), kv_a_layernorm, kv_b_proj
                         -> attn._W_KVA_lin (_b_KVA_lin), kv_a_norm.w, _W_KVB_lin
    self_attn.o_proj (+bias) -> attn._W_O_lin (b_O)
    mlp.gate.weight (+ e_score_correction_bias), mlp.experts.*, mlp.shared_experts.*  (``experts.py``)
    mlp.{gate,up,down}_proj on dense layers; norms, embeddings and lm_head as Llama's.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from torch import Tensor

from workbench.components.rotary import yarn_mscale
from workbench.config import LatentAttentionConfig, MoEConfig, ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig
from workbench.loading.hf.experts import (MoEKind, dense_gated_mlp, moe_layer_fields, read_experts, router_groups,
                                          with_moe_layers)

LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")

LATENT_NORM_EPS = 1e-6  # DeepseekV2/V3RMSNorm's default: the latent norms are built without rms_norm_eps


def _v2_router(hf: HFConfig) -> dict[str, Any]:
    method = hf.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise hf.refuse("topk_method", method, "DeepSeek-V2 routes with 'greedy' or 'group_limited_greedy'")
    _scoring_function(hf, "softmax")
    fields = {"router_scoring": "softmax", "router_renormalize": False}
    if method == "group_limited_greedy":
        fields.update(router_groups(hf), router_group_score="max")
    return fields


def _v3_router(hf: HFConfig) -> dict[str, Any]:
    _scoring_function(hf, "sigmoid")
    return {"router_scoring": "sigmoid", "router_score_correction": True, "router_group_score": "top2_sum",
            "router_renormalize": bool(hf.get("norm_topk_prob", True)), **router_groups(hf)}


def _scoring_function(hf: HFConfig, implemented: str) -> None:
    """The original checkpoints' ``scoring_func`` must be the one this architecture's code runs."""
    scoring = hf.get("scoring_func", implemented)
    if scoring != implemented:
        raise hf.refuse("scoring_func", scoring, f"this architecture scores experts with {implemented!r} only")


def _moe_kind(router) -> MoEKind:
    return MoEKind(("n_routed_experts",), "moe_intermediate_size", router, shared_prefix="mlp.shared_experts",
                   sparse_layers="first_k_dense_replace")


MOE = {"DeepseekV2ForCausalLM": _moe_kind(_v2_router), "DeepseekV3ForCausalLM": _moe_kind(_v3_router)}
# transformers' defaults for fields missing from config.json, where they matter.
DEFAULTS = {
    "DeepseekV2ForCausalLM": {"first_k_dense_replace": 0, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
                              "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
                              "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64},
    "DeepseekV3ForCausalLM": {"first_k_dense_replace": 3, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                              "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
                              "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
                              "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "rope_interleave": True},
}
# V2 always rotates adjacent pairs; V3 does with rope_interleave.
ADJACENT_PAIRS_FIELD = {"DeepseekV2ForCausalLM": None, "DeepseekV3ForCausalLM": "rope_interleave"}


def model_config(hf: HFConfig, architecture: str) -> ModelConfig:
    """Maps a DeepSeek-V2/V3 ``config.json`` onto ``ModelConfig``; values we cannot honour name their field.

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "num_attention_heads": 4, "num_hidden_layers": 2,
        ...                "intermediate_size": 80, "vocab_size": 101, "max_position_embeddings": 64,
        ...                "hidden_act": "silu", "kv_lora_rank": 16, "q_lora_rank": None,
        ...                "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12,
        ...                "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 20,
        ...                "first_k_dense_replace": 1, "n_shared_experts": 1}, "config.json")
        >>> cfg = model_config(hf, "DeepseekV2ForCausalLM")
        >>> cfg.d_head, cfg.rotary_dim, cfg.d_head_v, cfg.moe_layers
        (12, 4, 12, [1])
    """
    # A null field takes transformers' default, except q_lora_rank, whose null means "no query bottleneck".
    hf = HFConfig({**DEFAULTS[architecture], **{k: v for k, v in hf.data.items() if v is not None or k == "q_lora_rank"}},
                  hf.source)
    d_model, n_heads = int(hf.require("hidden_size")), int(hf.require("num_attention_heads"))
    n_layers = int(hf.require("num_hidden_layers"))
    n_kv = int(hf.get("num_key_value_heads", n_heads))
    if n_kv != n_heads:
        raise hf.refuse("num_key_value_heads", n_kv,
                        f"latent attention expands keys and values for every head: must equal num_attention_heads={n_heads}")
    nope, rope = int(hf.require("qk_nope_head_dim")), int(hf.require("qk_rope_head_dim"))
    rotary = hf.rotary(rope)
    kind = MOE[architecture]
    layers = with_moe_layers(rotary, moe_layer_fields(hf, kind, n_layers))
    pairs_field = ADJACENT_PAIRS_FIELD[architecture]
    q_lora_rank = hf.get("q_lora_rank")
    return hf.model_config(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_key_value_heads=n_heads, d_head=nope + rope,
        latent=LatentAttentionConfig(kv_lora_rank=int(hf.require("kv_lora_rank")), d_head_v=int(hf.require("v_head_dim")),
                                     q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
                                     latent_norm_eps=LATENT_NORM_EPS),
        attn_scale=math.sqrt(nope + rope) / mscale_squared(rotary["rotary_scaling"]),
        rotary_adjacent_pairs=bool(hf.get(pairs_field, True)) if pairs_field else True,
        d_vocab=int(hf.require("vocab_size")), n_ctx=int(hf.require("max_position_embeddings")),
        normalization="RMS", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), act_fn=hf.activation("hidden_act"),
        gated_mlp=True, attn_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=MoEConfig(**kind.router(hf), routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                      router_in_float32=True,
                      d_shared_expert=int(hf.require("moe_intermediate_size")) * int(hf.get("n_shared_experts", 0))),
        **layers,
    )


def mscale_squared(scaling: Optional[dict[str, Any]]) -> float:
    """DeepSeek's (and MiniCPM3's) softmax-scale correction: mscale(factor, mscale_all_dim)^2 with a scaled RoPE, else 1.

    Example:
        >>> round(mscale_squared({"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}), 4)
        1.2965
    """
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str) -> dict[str, Tensor]:
    """Reads every tensor the model needs, renamed to ours (a missing or mis-shaped one names itself).

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-deepseek")), cfg, "DeepseekV3ForCausalLM")   # doctest: +SKIP
    """
    out = latent_decoder_tensors(ckpt, cfg, architecture)
    _skip_prediction_layers(ckpt, cfg.n_layers)
    return out


def latent_decoder_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str) -> dict[str, Tensor]:
    """The embedding, final norm, unembedding and every decoder layer (norms, latent attention, a dense or MoE MLP)
    of a latent-attention model, renamed to ours (DeepSeek-V2/V3, MiniCPM3).

    Example:
        >>> tensors = latent_decoder_tensors(SafetensorsCheckpoint(Path("tiny-minicpm3")), cfg, "MiniCPM3ForCausalLM")  # doctest: +SKIP
    """
    V, D = cfg.d_vocab, cfg.d_model
    out = {"embed.W_E": ckpt.take("model.embed_tokens.weight", (V, D)),
           "ln_final.w": ckpt.take("model.norm.weight", (D,))}
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    for layer in range(cfg.n_layers):
        hf, ours = f"model.layers.{layer}", f"blocks.{layer}"
        out[f"{ours}.ln1.w"] = ckpt.take(f"{hf}.input_layernorm.weight", (D,))
        out[f"{ours}.ln2.w"] = ckpt.take(f"{hf}.post_attention_layernorm.weight", (D,))
        out.update(latent_attention_tensors(ckpt, cfg, layer))
        layer_cfg = cfg.for_layer(layer)
        if layer_cfg.is_moe:
            out.update(read_experts(ckpt, MOE[architecture], layer_cfg, layer))
        else:
            out.update(dense_gated_mlp(ckpt, f"{hf}.mlp", f"{ours}.mlp", layer_cfg.d_mlp, D, bias=cfg.mlp_bias))
    return out


def latent_attention_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, layer: int) -> dict[str, Tensor]:
    """One layer's latent attention (``self_attn.q_proj | q_a_proj, q_a_layernorm, q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, their biases) renamed to ours
    (DeepSeek-V2/V3, MiniCPM3).

    Example:
        >>> latent_attention_tensors(ckpt, cfg, 0)["blocks.0.attn._W_KVA_lin"].shape   # doctest: +SKIP
        torch.Size([20, 48])
    """
    H, K, R, J, D = cfg.n_heads, cfg.d_head, cfg.rotary_dim, cfg.d_head_v, cfg.d_model
    A, Q = cfg.latent.kv_lora_rank, cfg.latent.q_lora_rank
    hf, ours = f"model.layers.{layer}.self_attn", f"blocks.{layer}.attn"
    out = {}
    if Q is None:
        out[f"{ours}._W_Q_lin"] = ckpt.take(f"{hf}.q_proj.weight", (H * K, D))
    else:
        out[f"{ours}._W_QA_lin"] = ckpt.take(f"{hf}.q_a_proj.weight", (Q, D))
        out[f"{ours}.q_a_norm.w"] = ckpt.take(f"{hf}.q_a_layernorm.weight", (Q,))
        out[f"{ours}._W_QB_lin"] = ckpt.take(f"{hf}.q_b_proj.weight", (H * K, Q))
        if cfg.attn_bias:
            out[f"{ours}._b_QA_lin"] = ckpt.take(f"{hf}.q_a_proj.bias", (Q,))
    out[f"{ours}._W_KVA_lin"] = ckpt.take(f"{hf}.kv_a_proj_with_mqa.weight", (A + R, D))
    out[f"{ours}.kv_a_norm.w"] = ckpt.take(f"{hf}.kv_a_layernorm.weight", (A,))
    out[f"{ours}._W_KVB_lin"] = ckpt.take(f"{hf}.kv_b_proj.weight", (H * (K - R + J), A))
    out[f"{ours}._W_O_lin"] = ckpt.take(f"{hf}.o_proj.weight", (D, H * J))
    if cfg.attn_bias:
        out[f"{ours}._b_KVA_lin"] = ckpt.take(f"{hf}.kv_a_proj_with_mqa.bias", (A + R,))
        out[f"{ours}.b_O"] = ckpt.take(f"{hf}.o_proj.bias", (D,))
    return out


def _skip_prediction_layers(ckpt: SafetensorsCheckpoint, n_layers: int) -> None:
    """DeepSeek-V3 checkpoints carry multi-token-prediction layers after the last decoder layer
    (``model.layers.{n_layers}...``), which transformers does not load either; anything else left
    over is still reported by the loader."""
    for name in ckpt.untaken():
        match = LAYER_INDEX.match(name)
        if match and int(match.group(1)) >= n_layers:
            ckpt.skip(name)


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={
        "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepSeek-V2, V2-Lite (latent attention, group-limited softmax routing)"),
        "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepSeek-V3, R1 (latent attention, sigmoid routing with correction bias)"),
    },
    model_config=model_config,
    convert_tensors=convert_tensors,
    # RoPE buffers that older checkpoints carry are recomputed.
    ignored_tensors=re.compile(r".*rotary_emb\.inv_freq$"),
),)
