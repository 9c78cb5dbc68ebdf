"""The Llama family in HF format: Llama 1-3 (RoPE scalings), Mistral, Mixtral, Qwen2/2.5, Qwen3,
Qwen2-MoE, Qwen3-MoE, gpt-oss, SmolLM3, OLMo and OLMo 2.

Legend: E num_experts, H n_heads, G n_key_value_heads, K d_head, M d_mlp, D d_model, V d_vocab.

All are decoders with RoPE, grouped-query attention and a SwiGLU MLP. They differ only in config
values, which ``Variant`` records (read off transformers 5.23's ``modeling_*.py``):

    Llama     attention_bias (q, k, v and o) and mlp_bias switches; RoPE scaling linear/dynamic/llama3/yarn
    Mistral   one sliding window on every layer (when ``sliding_window`` is set)
    Mixtral   Mistral with a mixture of experts
    Qwen2-MoE Qwen2's attention (qkv_bias); experts with a sigmoid-gated shared expert, dense mlp_only_layers
    Qwen3-MoE Qwen3's attention; experts on the layers decoder_sparse_step picks
    gpt-oss   biased attention with a sink per head, alternating windows (layer_types), YaRN; biased
              router (top-k then softmax) and clamped-SwiGLU experts with biases
    Qwen2     q, k, v always biased (o never); sliding windows on the layers ``layer_types`` names
              (older configs: from ``max_window_layers`` on, when ``use_sliding_window``)
    Qwen3     Qwen2's windows; attention_bias on all four; an RMS QK norm over d_head with one [K]
              gain shared by every head (``qk_norm="head"``, repeated to [H, K] / [G, K])
    SmolLM3   Llama plus layers without RoPE (``no_rope_layers``: 0 = NoPE), windows on NoPE layers
    OLMo      LayerNorm without parameters (eps 1e-5: gains of one and biases of zero are filled in);
              q, k and v clamped to ``clip_qkv``
    OLMo 2    RMSNorm after each sublayer only, before the residual add (``norm_placement=
              "sublayer_output"``); QK norm over the whole q / k projection (``qk_norm="projection"``)

``modern`` declares more Llama-like architectures (Granite, Cohere, GLM, Nemotron ...) as a table of
``Variant``s of its own, read by this module's ``model_config`` and ``convert_tensors`` (their
``variants`` argument); the switches after ``defaults`` in ``Variant`` exist for them.

A field missing from config.json takes the architecture's transformers default (Qwen3's head_dim
is 128, SmolLM3's rope_theta 2e6 and its NoPE layers every 4th, Mistral's window 4096, ...).
HF tensor names (transformers 5.23 ``save_pretrained``) and ours (the nn.Linear-layout storage,
whose TransformerLens views are ``W_Q``, ``W_in``, ``W_U`` ...):

    model.embed_tokens.weight                  -> embed.W_E
    model.layers.{l}.input_layernorm.weight    -> blocks.{l}.ln1.w   (post_attention_layernorm -> ln2.w)
        OLMo 2: post_attention_layernorm -> ln1_post.w, post_feedforward_layernorm -> ln2_post.w
        OLMo: no norm tensors; ln1/ln2/ln_final .w = 1, .b = 0
    model.layers.{l}.self_attn.{q,k,v,o}_proj  -> blocks.{l}.attn._W_{Q,K,V,O}_lin (+ .bias -> _b_{Q,K,V}_lin, b_O)
    model.layers.{l}.self_attn.{q,k}_norm      -> blocks.{l}.attn.{q,k}_norm.w   (Qwen3 [K] -> [H, K] / [G, K];
                                                                                  OLMo 2 [H*K] / [G*K])
    model.layers.{l}.mlp.{gate,up,down}_proj   -> blocks.{l}.mlp._W_{gate,in,out}_lin (+ .bias -> b_{gate,in,out})
    model.layers.{l}.block_sparse_moe.gate     -> blocks.{l}.mlp._W_router_lin          (Mixtral)
    ...block_sparse_moe.experts.{e}.w{1,3,2}   -> blocks.{l}.mlp._W_{gate,in,out}_lin[e] (stacked over e)
    model.norm.weight -> ln_final.w;  lm_head.weight -> unembed._W_U_lin (absent when tied)

Mixtral's experts may also come fused, as transformers holds them in memory
(``mlp.experts.gate_up_proj`` [E, 2M, D] with gate rows first, ``mlp.experts.down_proj``
[E, D, M]); both spellings load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from workbench.config import MoEConfig, ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig
from workbench.loading.hf.experts import (MOE_KINDS, dense_gated_mlp, dense_mlp, fused_gated_mlp, moe_layer_fields,
                                          read_experts, with_moe_layers)
from workbench.loading.hf.llama_layers import attention_layers

OLMO_LAYER_NORM_EPS = 1e-5  # OlmoLayerNorm's eps is fixed; its config has no field for it


@dataclass(frozen=True)
class Variant:
    """What distinguishes one member of the family, as data rather than branches on a name."""

    qkv_bias_field: Optional[str] = None  # config field switching q/k/v/o biases on (Llama: attention_bias)
    qkv_bias_always: bool = False  # Qwen2: q/k/v always biased
    o_proj_bias: bool = True  # False: o_proj has no bias even when q/k/v have (Qwen2, Qwen2-MoE)
    mlp_bias_field: Optional[str] = None  # config field switching the MLP biases on (Llama: mlp_bias)
    # Which layers have a sliding window (a key of llama_layers.SLIDING_RULES).
    sliding: str = "none"
    nope_layers: bool = False  # honours no_rope_layers (SmolLM3)
    moe: Optional[str] = None  # the kind of mixture of experts (a key of experts.MOE_KINDS)
    sinks: bool = False  # gpt-oss: a learned sink logit per head (self_attn.sinks)
    normalization: str = "RMS"
    norm_params: bool = True  # False: OLMo's LayerNorm has no gain or bias
    norm_eps_field: Optional[str] = "rms_norm_eps"  # None: the eps is fixed at ``norm_eps``
    norm_eps: float = 1e-6  # the default (or fixed) eps
    norm_placement: str = "pre"
    qk_norm: Optional[str] = None  # "head" (Qwen3) or "projection" (OLMo 2)
    clip_qkv_field: Optional[str] = None  # OLMo: clip_qkv
    # transformers' defaults for fields missing from config.json, where they differ from Llama's.
    defaults: dict[str, Any] = field(default_factory=dict)
    # ---- the modern families' switches (modern) ----
    o_bias_field: Optional[str] = None  # o_proj's own bias switch (Seed-OSS); None: as q/k/v (o_proj_bias)
    rotary_adjacent_pairs: bool = False  # RoPE on adjacent pairs (Helium, ERNIE 4.5, GLM)
    qk_norm_names: tuple[str, str] = ("q_norm", "k_norm")  # the QK norms' tensor names (HunYuan's differ)
    fused_gate_up: bool = False  # GLM: one mlp.gate_up_proj [2M, D], gate rows first
    gated_mlp: bool = True  # False: up_proj, act, down_proj (Nemotron, Arcee)
    partial_rotary: bool = False  # honours partial_rotary_factor (GLM, Nemotron); else refused
    norm_bias: bool = False  # a LayerNorm's bias is read (Nemotron); else zero (Cohere's have none)
    norm_gain_offset: float = 0.0  # added to every norm gain (Nemotron's LayerNorm1P: 1 + w)
    layer_norms: Optional[tuple[tuple[str, str], ...]] = None  # (ours, HF) norms of a layer; None: LAYER_NORMS
    qk_norm_gains_per_head: bool = False  # Cohere: [H, K] / [G, K] QK-norm gains, not one shared [K]
    # config.json data -> the data this table reads: transformers' computed defaults (layer_types ...)
    # and spellings of the same model this table knows (HunYuan's fixed NTK alpha as a RoPE base).
    prepare: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None
    # ModelConfig fields beyond the common ones, from the prepared config (Granite's multipliers).
    extra_fields: Optional[Callable[[HFConfig], dict[str, Any]]] = None
    # ---- the mixture-of-experts families' switches (moe_families) ----
    unembed_bias_field: Optional[str] = None  # config field giving lm_head a bias (Phi-3.5-MoE: lm_head_bias)


_QWEN_DEFAULTS = {"num_key_value_heads": 32, "max_window_layers": 28, "sliding_window": 4096,
                  "use_sliding_window": False}

_GPT_OSS_DEFAULTS = {"num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128, "attention_bias": True,
                     "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
                     "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 4096}}

VARIANTS = {
    "LlamaForCausalLM": Variant(qkv_bias_field="attention_bias", mlp_bias_field="mlp_bias"),
    "MistralForCausalLM": Variant(sliding="every_layer", defaults={"num_key_value_heads": 8, "sliding_window": 4096}),
    "MixtralForCausalLM": Variant(sliding="every_layer", moe="mixtral", norm_eps=1e-5,
                                  defaults={"num_key_value_heads": 8}),
    "Qwen2ForCausalLM": Variant(qkv_bias_always=True, o_proj_bias=False, sliding="from_max_window_layers",
                                defaults=_QWEN_DEFAULTS),
    "Qwen2MoeForCausalLM": Variant(qkv_bias_field="qkv_bias", o_proj_bias=False, sliding="qwen2_moe", moe="qwen2_moe",
                                   defaults={**_QWEN_DEFAULTS, "num_key_value_heads": 16, "qkv_bias": True}),
    "Qwen3MoeForCausalLM": Variant(qkv_bias_field="attention_bias", sliding="every_layer_if_used", qk_norm="head",
                                   moe="qwen3_moe", defaults={"num_key_value_heads": 4, "use_sliding_window": False}),
    "GptOssForCausalLM": Variant(qkv_bias_field="attention_bias", sliding="layer_types", moe="gpt_oss", sinks=True,
                                 norm_eps=1e-5, defaults=_GPT_OSS_DEFAULTS),
    "Qwen3ForCausalLM": Variant(qkv_bias_field="attention_bias", sliding="from_max_window_layers", qk_norm="head",
                                defaults={**_QWEN_DEFAULTS, "head_dim": 128}),
    "SmolLM3ForCausalLM": Variant(qkv_bias_field="attention_bias", mlp_bias_field="mlp_bias", sliding="nope_layers",
                                  nope_layers=True,
                                  defaults={"num_key_value_heads": 4, "tie_word_embeddings": True,
                                            "rope_theta": 2000000.0, "no_rope_layer_interval": 4,
                                            "use_sliding_window": False}),
    "OlmoForCausalLM": Variant(qkv_bias_field="attention_bias", normalization="LN", norm_params=False,
                               norm_eps_field=None, norm_eps=OLMO_LAYER_NORM_EPS, clip_qkv_field="clip_qkv"),
    "Olmo2ForCausalLM": Variant(qkv_bias_field="attention_bias", norm_eps=1e-5, norm_placement="sublayer_output",
                                qk_norm="projection"),
}

# Our norm -> the HF norm of a decoder layer, per norm placement.
LAYER_NORMS = {
    "pre": (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")),
    "sublayer_output": (("ln1_post", "post_attention_layernorm"), ("ln2_post", "post_feedforward_layernorm")),
    "sandwich": (("ln1", "input_layernorm"), ("ln1_post", "post_self_attn_layernorm"),  # GLM-4
                 ("ln2", "post_attention_layernorm"), ("ln2_post", "post_mlp_layernorm")),
}


def model_config(hf: HFConfig, architecture: str, variants: Optional[dict[str, Variant]] = None) -> ModelConfig:
    """Maps a Llama-family ``config.json`` onto ``ModelConfig``; unsupported values name their field.

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2,
        ...                "num_hidden_layers": 2, "intermediate_size": 80, "vocab_size": 101,
        ...                "max_position_embeddings": 64, "hidden_act": "silu"}, "config.json")
        >>> model_config(hf, "LlamaForCausalLM").n_query_groups
        3
    """
    variant = (variants or VARIANTS)[architecture]
    hf = HFConfig({**variant.defaults, **hf.data}, hf.source)  # a missing field: transformers' default
    if variant.prepare is not None:
        hf = HFConfig(variant.prepare(dict(hf.data)), hf.source)
    d_model, n_heads = int(hf.require("hidden_size")), int(hf.require("num_attention_heads"))
    n_layers = int(hf.require("num_hidden_layers"))
    head_dim = int(hf.get("head_dim", d_model // n_heads))
    if not variant.partial_rotary:
        _refuse_partial_rotary(hf)
    attn_bias = variant.qkv_bias_always or bool(variant.qkv_bias_field and hf.get(variant.qkv_bias_field, False))
    attn_bias = attn_bias or bool(variant.o_bias_field and hf.get(variant.o_bias_field, False))
    norm_eps = float(hf.get(variant.norm_eps_field, variant.norm_eps)) if variant.norm_eps_field else variant.norm_eps
    clip_qkv = hf.get(variant.clip_qkv_field) if variant.clip_qkv_field else None
    layers = attention_layers(hf, variant.sliding, variant.nope_layers, n_layers, head_dim)
    moe = {}
    if variant.moe:
        kind = MOE_KINDS[variant.moe]
        layers = with_moe_layers(layers, moe_layer_fields(hf, kind, n_layers))
        moe = {"moe": MoEConfig(**kind.router(hf))}
    else:
        layers["d_mlp"] = int(hf.require("intermediate_size"))
    fields = dict(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads,
        n_key_value_heads=int(hf.get("num_key_value_heads", n_heads)), d_head=head_dim,
        d_vocab=int(hf.require("vocab_size")), n_ctx=int(hf.require("max_position_embeddings")),
        normalization=variant.normalization, norm_eps=norm_eps, norm_placement=variant.norm_placement,
        qk_norm=variant.qk_norm, clip_qkv=None if clip_qkv is None else float(clip_qkv),
        act_fn=hf.activation("hidden_act"), gated_mlp=variant.gated_mlp, attn_bias=attn_bias,
        mlp_bias=bool(variant.mlp_bias_field and hf.get(variant.mlp_bias_field, False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), attn_sinks=variant.sinks,
        unembed_bias=bool(variant.unembed_bias_field and hf.get(variant.unembed_bias_field, False)),
        rotary_adjacent_pairs=variant.rotary_adjacent_pairs, **layers, **moe,
    )
    return hf.model_config(**{**fields, **(variant.extra_fields(hf) if variant.extra_fields else {})})


def _refuse_partial_rotary(hf: HFConfig) -> None:
    """These architectures rotate the whole head: transformers ignores ``partial_rotary_factor``
    with plain RoPE and fails on it with a scaled one, so a checkpoint asking for it is refused."""
    specs = [("", hf.data), ("rope_parameters.", hf.get("rope_parameters", {})),
             ("rope_scaling.", hf.get("rope_scaling", {}))]
    for prefix, spec in specs:
        factor = spec.get("partial_rotary_factor") if isinstance(spec, dict) else None
        if factor is not None and float(factor) != 1.0:
            raise hf.refuse(f"{prefix}partial_rotary_factor", factor,
                            "this architecture applies RoPE to the whole head in transformers")


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str = "LlamaForCausalLM",
                    variants: Optional[dict[str, Variant]] = None) -> dict[str, Tensor]:
    """Reads every tensor the model needs, renamed to ours; a missing or mis-shaped one is a
    ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-llama")), cfg)   # doctest: +SKIP
        >>> tensors["blocks.0.attn._W_K_lin"].shape                                    # doctest: +SKIP
        torch.Size([16, 48])
    """
    variant = (variants or VARIANTS)[architecture]
    V, D = cfg.d_vocab, cfg.d_model
    out = {"embed.W_E": ckpt.take("model.embed_tokens.weight", (V, D))}
    like = out["embed.W_E"]
    out.update(_norm(ckpt, cfg, variant, "model.norm", "ln_final", like))
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    if cfg.unembed_bias:
        out["unembed.b_U"] = ckpt.take("lm_head.bias", (V,))
    for layer in range(cfg.n_layers):
        hf, ours = f"model.layers.{layer}", f"blocks.{layer}"
        read = set()
        for our_norm, hf_norm in variant.layer_norms or LAYER_NORMS[variant.norm_placement]:
            norm = _norm(ckpt, cfg, variant, f"{hf}.{hf_norm}", f"{ours}.{our_norm}", like)
            # Cohere's one norm feeds both sublayers: a clone for ln2, so each can be edited alone
            out.update({name: t.clone() for name, t in norm.items()} if hf_norm in read else norm)
            read.add(hf_norm)
        out.update(_attention(ckpt, cfg, variant, layer))
        layer_cfg = cfg.for_layer(layer)
        if layer_cfg.is_moe:
            out.update(read_experts(ckpt, MOE_KINDS[variant.moe], layer_cfg, layer))
        elif variant.fused_gate_up:
            out.update(fused_gated_mlp(ckpt, f"{hf}.mlp", f"{ours}.mlp", layer_cfg.d_mlp, D))
        elif not variant.gated_mlp:
            out.update(dense_mlp(ckpt, f"{hf}.mlp", f"{ours}.mlp", layer_cfg.d_mlp, D, cfg.mlp_bias, cfg.act_fn))
        else:
            out.update(dense_gated_mlp(ckpt, f"{hf}.mlp", f"{ours}.mlp", layer_cfg.d_mlp, D, bias=cfg.mlp_bias))
    return out


def _norm(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, variant: Variant, hf: str, ours: str,
          like: Tensor) -> dict[str, Tensor]:
    """One [D] norm: its HF gain (plus ``norm_gain_offset``) and, for a LayerNorm, its bias or zero; or
    (OLMo's parameter-free LayerNorm) a gain of one and bias of zero."""
    D = cfg.d_model
    if not variant.norm_params:
        out = {f"{ours}.w": torch.ones(D, dtype=like.dtype)}
    else:
        gain = ckpt.take(f"{hf}.weight", (D,))
        out = {f"{ours}.w": gain + variant.norm_gain_offset if variant.norm_gain_offset else gain}
    if cfg.normalization == "LN":
        out[f"{ours}.b"] = (ckpt.take(f"{hf}.bias", (D,)) if variant.norm_params and variant.norm_bias
                            else torch.zeros(D, dtype=like.dtype))
    return out


def _attention(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, variant: Variant, layer: int) -> dict[str, Tensor]:
    """Projections, biases and QK-norm gains of one layer's attention."""
    H, G, K, D = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model
    hf, ours = f"model.layers.{layer}.self_attn", f"blocks.{layer}.attn"
    shapes = {"q": ((H * K, D), (H * K,)), "k": ((G * K, D), (G * K,)), "v": ((G * K, D), (G * K,)),
              "o": ((D, H * K), (D,))}
    out = {}
    for proj, (weight_shape, bias_shape) in shapes.items():
        name = proj.upper()
        out[f"{ours}._W_{name}_lin"] = ckpt.take(f"{hf}.{proj}_proj.weight", weight_shape)
        if not cfg.attn_bias:
            continue
        ours_bias = f"{ours}.b_O" if proj == "o" else f"{ours}._b_{name}_lin"
        has_bias = variant.o_proj_bias or proj != "o"  # Qwen2: q/k/v biased, o_proj never
        if variant.o_bias_field is not None:  # Seed-OSS: q/k/v and o switched apart; what the config left off is absent
            has_bias = ckpt.has(f"{hf}.{proj}_proj.bias")
        out[ours_bias] = (ckpt.take(f"{hf}.{proj}_proj.bias", bias_shape) if has_bias
                          else torch.zeros(bias_shape, dtype=out[f"{ours}._W_{name}_lin"].dtype))
    q_norm, k_norm = variant.qk_norm_names
    if cfg.qk_norm == "head" and variant.qk_norm_gains_per_head:  # Cohere: a gain per head already
        out[f"{ours}.q_norm.w"] = ckpt.take(f"{hf}.{q_norm}.weight", (H, K))
        out[f"{ours}.k_norm.w"] = ckpt.take(f"{hf}.{k_norm}.weight", (G, K))
    elif cfg.qk_norm == "head":  # one [K] gain shared by every head, as ours per head
        out[f"{ours}.q_norm.w"] = ckpt.take(f"{hf}.{q_norm}.weight", (K,)).expand(H, K).clone()
        out[f"{ours}.k_norm.w"] = ckpt.take(f"{hf}.{k_norm}.weight", (K,)).expand(G, K).clone()
    elif cfg.qk_norm == "projection":
        out[f"{ours}.q_norm.w"] = ckpt.take(f"{hf}.{q_norm}.weight", (H * K,))
        out[f"{ours}.k_norm.w"] = ckpt.take(f"{hf}.{k_norm}.weight", (G * K,))
    if cfg.qk_norm is not None and cfg.normalization == "LN":  # Cohere's LayerNorms have no bias
        for name in ("q_norm", "k_norm"):
            out[f"{ours}.{name}.b"] = torch.zeros_like(out[f"{ours}.{name}.w"])
    if cfg.attn_sinks:
        out[f"{ours}.sinks"] = ckpt.take(f"{hf}.sinks", (H,))
    return out


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={
        "LlamaForCausalLM": ("llama", "Llama 1-3 (RoPE scaling: linear, dynamic, llama3, yarn)"),
        "MistralForCausalLM": ("mistral", "Mistral"),
        "Qwen2ForCausalLM": ("qwen2", "Qwen2, Qwen2.5 (yarn, sliding windows on some layers)"),
        "Qwen3ForCausalLM": ("qwen3", "Qwen3"),
        "SmolLM3ForCausalLM": ("smollm3", "SmolLM3"),
        "MixtralForCausalLM": ("mixtral", "Mixtral"),
        "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2-MoE, Qwen1.5-MoE (a sigmoid-gated shared expert)"),
        "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3-MoE"),
        "GptOssForCausalLM": ("gpt_oss", "gpt-oss (attention sinks, alternating windows, clamped SwiGLU experts)"),
        "OlmoForCausalLM": ("olmo", "OLMo"),
        "Olmo2ForCausalLM": ("olmo2", "OLMo 2"),
    },
    model_config=model_config,
    convert_tensors=convert_tensors,
    # Buffers older checkpoints carry that are not parameters (RoPE's inverse frequencies are recomputed).
    ignored_tensors=re.compile(r".*rotary_emb\.inv_freq$"),
),)
