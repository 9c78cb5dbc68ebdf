"""Gemma, Gemma 2 and Gemma 3 (text) in HF format.

Legend: H n_heads, G n_key_value_heads, K d_head, D d_model, M d_mlp, V d_vocab.

All three are RMSNorm decoders with RoPE, grouped-query attention, a GeGLU MLP (``gate_proj``
through gelu with the tanh approximation, times ``up_proj``), token embeddings multiplied by
sqrt(D) (``embed_scale``) and, by default, tied embeddings. Gemma's RMSNorm computes
x / rms * (1 + w) in float32; ours computes w * x / rms, so every norm gain gets 1 added on loading
(QK norms included). They differ in config values, which ``Variant`` records:

- Gemma 2 and 3 wrap attention and the MLP in "sandwich" norms (``post_attention_layernorm``
  is then the norm *after* attention, not the one before the MLP), scale scores by
  ``query_pre_attn_scalar`` ** -0.5 instead of ``head_dim`` ** -0.5 (``attn_scale`` =
  sqrt(query_pre_attn_scalar)), soft-cap the logits (``final_logit_softcapping``) and alternate
  sliding-window and full layers (``layer_types``; configs without it take transformers'
  pattern: every 2nd layer full in Gemma 2, every ``sliding_window_pattern``-th (6) in Gemma 3).
- Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``). Gemma 3's config has the
  field too, but transformers' Gemma 3 attention never applies it, so neither do we.
- Gemma 3 norms q and k per head (``q_norm``/``k_norm``, one [K] gain shared by all heads) and
  gives each layer type its own RoPE: ``rope_parameters`` keyed by "sliding_attention" /
  "full_attention", or in older configs ``rope_local_base_freq`` (local layers), ``rope_theta``
  and ``rope_scaling`` (global layers only).

HF tensor names (transformers 5.23 ``save_pretrained``) and ours (the nn.Linear-layout storage,
whose TransformerLens views are ``W_Q``, ``W_in``, ``W_U`` ...); "+1" marks a gain stored as w
that we store as 1 + w:

    model.embed_tokens.weight                        -> embed.W_E
    model.layers.{l}.input_layernorm.weight          -> blocks.{l}.ln1.w                       (+1)
    model.layers.{l}.post_attention_layernorm.weight -> blocks.{l}.ln2.w  (Gemma: before the MLP) (+1)
                                                     -> blocks.{l}.ln1_post.w (Gemma 2, 3)       (+1)
    model.layers.{l}.pre_feedforward_layernorm.weight  -> blocks.{l}.ln2.w      (Gemma 2, 3)   (+1)
    model.layers.{l}.post_feedforward_layernorm.weight -> blocks.{l}.ln2_post.w (Gemma 2, 3)   (+1)
    model.layers.{l}.self_attn.{q,k,v,o}_proj        -> blocks.{l}.attn._W_{Q,K,V,O}_lin
                                                        (+ .bias -> _b_{Q,K,V}_lin, b_O with attention_bias)
    model.layers.{l}.self_attn.{q,k}_norm.weight [K] -> blocks.{l}.attn.{q,k}_norm.w [H, K] / [G, K]
                                                        (Gemma 3; +1, repeated for every head)
    model.layers.{l}.mlp.{gate,up,down}_proj         -> blocks.{l}.mlp._W_{gate,in,out}_lin
    model.norm.weight -> ln_final.w (+1);  lm_head.weight -> unembed._W_U_lin (absent when tied)

VaultGemma is Gemma 2 with pre-norm blocks only: ``input_layernorm`` -> ln1, ``pre_feedforward_layernorm``
-> ln2 (+1 each).

The multimodal ``Gemma3ForConditionalGeneration`` is not a decoder-only checkpoint and is not
registered: it is refused as an unknown architecture.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig

# transformers' config defaults for the fields a config.json may leave out (an absent field takes
# its class default there, which is not always ours: e.g. Gemma 2 caps logits at 30 by default).
_COMMON_DEFAULTS = {"head_dim": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False}
_LATER_DEFAULTS = {**_COMMON_DEFAULTS, "num_key_value_heads": 4, "hidden_activation": "gelu_pytorch_tanh",
                   "query_pre_attn_scalar": 256, "sliding_window": 4096}
# Fields other families use for windows and RoPE that transformers' Gemma never reads.
_UNREAD_ATTENTION_FIELDS = ("use_sliding_window", "max_window_layers", "no_rope_layers")
_SLIDING, _FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Variant:
    """What distinguishes one Gemma generation, as data rather than branches on a name."""

    activation_field: str  # the config field naming the MLP's activation
    defaults: dict[str, Any] = field(default_factory=dict)  # transformers' defaults for absent fields
    legacy_gelu_is_tanh: bool = False  # Gemma's config rewrites the legacy "gelu" to the tanh approximation
    sandwich: bool = False  # four norms per block (post_attention_layernorm then follows attention)
    # layer_types absent: every n-th layer full, the rest sliding; None: no sliding windows at all
    window_pattern: Optional[int] = None
    window_pattern_field: Optional[str] = None  # older configs' field for that n (Gemma 3)
    query_pre_attn_scalar: bool = False  # scores scaled by query_pre_attn_scalar ** -0.5
    attn_soft_cap: bool = False  # attn_logit_softcapping applied (Gemma 2 only; Gemma 3 ignores it)
    logit_soft_cap: bool = False  # final_logit_softcapping applied
    qk_norm: bool = False
    rope_per_layer_type: bool = False  # rope_parameters keyed by layer type, older fields mapped to them
    # The norms of a pre-norm block when they are not Gemma's (VaultGemma: pre_feedforward_layernorm before the MLP).
    pre_norms: Optional[dict[str, str]] = None


VARIANTS = {
    "GemmaForCausalLM": Variant(
        activation_field="hidden_act", legacy_gelu_is_tanh=True,
        defaults={**_COMMON_DEFAULTS, "num_key_value_heads": 16, "hidden_act": "gelu_pytorch_tanh",
                  "max_position_embeddings": 8192}),
    "Gemma2ForCausalLM": Variant(
        activation_field="hidden_activation", sandwich=True, window_pattern=2, query_pre_attn_scalar=True,
        attn_soft_cap=True, logit_soft_cap=True,
        defaults={**_LATER_DEFAULTS, "max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
                  "attn_logit_softcapping": 50.0}),
    # VaultGemma: Gemma 2's attention and caps, two norms per block (input_layernorm, pre_feedforward_layernorm).
    "VaultGemmaForCausalLM": Variant(
        activation_field="hidden_activation", window_pattern=2, query_pre_attn_scalar=True, attn_soft_cap=True,
        logit_soft_cap=True, pre_norms={"input_layernorm": "ln1", "pre_feedforward_layernorm": "ln2"},
        defaults={**_LATER_DEFAULTS, "max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
                  "attn_logit_softcapping": 50.0}),
    "Gemma3ForCausalLM": Variant(
        activation_field="hidden_activation", sandwich=True, window_pattern=6,
        window_pattern_field="sliding_window_pattern", query_pre_attn_scalar=True, logit_soft_cap=True,
        qk_norm=True, rope_per_layer_type=True,
        defaults={**_LATER_DEFAULTS, "max_position_embeddings": 131072, "final_logit_softcapping": None}),
}


def model_config(hf: HFConfig, architecture: str) -> ModelConfig:
    """Maps a Gemma-family ``config.json`` onto ``ModelConfig``; unsupported values name their field.

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2,
        ...                "head_dim": 8, "num_hidden_layers": 2, "intermediate_size": 80,
        ...                "vocab_size": 101, "max_position_embeddings": 64, "sliding_window": 5,
        ...                "query_pre_attn_scalar": 32}, "config.json")
        >>> cfg = model_config(hf, "Gemma2ForCausalLM")
        >>> cfg.layer_values("sliding_window"), cfg.attn_scale, cfg.output_logits_soft_cap
        ([5, None], 5.656854249492381, 30.0)
    """
    variant = VARIANTS[architecture]
    hf = _as_transformers_reads_it(hf, variant)
    if hf.get("use_bidirectional_attention"):
        raise hf.refuse("use_bidirectional_attention", hf.get("use_bidirectional_attention"),
                        "only causal (left-to-right) attention is supported")
    d_model, n_heads = int(hf.require("hidden_size")), int(hf.require("num_attention_heads"))
    n_layers, head_dim = int(hf.require("num_hidden_layers")), int(hf.require("head_dim"))
    scale = float(hf.require("query_pre_attn_scalar")) ** 0.5 if variant.query_pre_attn_scalar else None
    return hf.model_config(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads,
        n_key_value_heads=int(hf.require("num_key_value_heads")), d_head=head_dim,
        d_mlp=int(hf.require("intermediate_size")), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.require("max_position_embeddings")),
        normalization="RMS", norm_eps=float(hf.require("rms_norm_eps")),
        norm_placement="sandwich" if variant.sandwich else "pre",
        act_fn=_activation(hf, variant), gated_mlp=True, attn_bias=bool(hf.get("attention_bias")),
        tie_embeddings=bool(hf.get("tie_word_embeddings")), embed_scale=d_model ** 0.5,  # as transformers computes it
        attn_scale=scale, qk_norm="head" if variant.qk_norm else None,
        attn_scores_soft_cap=_soft_cap(hf, "attn_logit_softcapping") if variant.attn_soft_cap else None,
        output_logits_soft_cap=_soft_cap(hf, "final_logit_softcapping") if variant.logit_soft_cap else None,
        **hf.attention_layers(n_layers, head_dim),
    )


def _as_transformers_reads_it(hf: HFConfig, variant: Variant) -> HFConfig:
    """The config with what transformers' Gemma config classes derive made explicit: defaults for
    absent fields, ``layer_types`` from the window pattern, Gemma 3's RoPE per layer type, and no
    fields that Gemma never reads (so the shared readers cannot act on them)."""
    unread = set(_UNREAD_ATTENTION_FIELDS)
    if not variant.window_pattern:  # Gemma: every layer attends to the whole prefix
        unread |= {"layer_types", "sliding_window"}
    data = {key: value for key, value in {**variant.defaults, **hf.data}.items() if key not in unread}
    if variant.window_pattern and data.get("layer_types") is None:
        pattern_field = variant.window_pattern_field
        every = int((data.get(pattern_field) if pattern_field else None) or variant.window_pattern)
        n_layers = int(hf.require("num_hidden_layers"))
        data["layer_types"] = [_SLIDING if (i + 1) % every else _FULL for i in range(n_layers)]
    if variant.rope_per_layer_type:
        data["rope_parameters"] = _rope_per_layer_type(data)
        for older in ("rope_scaling", "rope_theta", "rope_local_base_freq"):
            data.pop(older, None)
    return HFConfig(_whole_head_rotary(hf, data), hf.source)


def _rope_per_layer_type(data: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's RoPE as transformers builds it (``Gemma3TextConfig.convert_rope_params_to_dict``):
    ``rope_parameters`` keyed by layer type; older configs' ``rope_scaling`` and ``rope_theta``
    (default 1e6) go to full-attention layers, ``rope_local_base_freq`` (default 1e4) to sliding ones.
    As there, ``rope_scaling`` is merged into ``{"rope_type": "default"}``, so one spelled with
    "type" instead of "rope_type" leaves the layers unscaled.

    Example:
        >>> _rope_per_layer_type({"rope_theta": 1e6, "rope_local_base_freq": 1e4,
        ...                       "rope_scaling": {"rope_type": "linear", "factor": 8.0}})["full_attention"]
        {'rope_type': 'linear', 'factor': 8.0, 'rope_theta': 1000000.0}
    """
    params = copy.deepcopy(data.get("rope_parameters") or {})
    full = params.get(_FULL) or {"rope_type": "default"}
    full.update(data.get("rope_scaling") or {})
    full.setdefault("rope_theta", data.get("rope_theta") or 1_000_000.0)
    local = params.get(_SLIDING) or {"rope_type": "default"}
    local.setdefault("rope_theta", data.get("rope_local_base_freq") or 10_000.0)
    for spec in (full, local):
        spec.setdefault("rope_type", spec.get("type", "default"))
    return {**params, _FULL: full, _SLIDING: local}


def _whole_head_rotary(hf: HFConfig, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without ``partial_rotary_factor``: transformers' Gemma rotates whole heads. Its
    unscaled RoPE ignores the factor (so do we); its scaled ones build cos/sin too short for the
    heads and fail, so there the factor is refused."""
    params = data.get("rope_parameters") or {}
    specs = [spec for spec in params.values() if isinstance(spec, dict)] or [params]  # per layer type, or one
    specs.append(data.get("rope_scaling") or {})
    factors = [data.get("partial_rotary_factor"), *(spec.get("partial_rotary_factor") for spec in specs)]
    factor = next((f for f in factors if f not in (None, 1)), None)
    if factor is None:
        return data
    kinds = [spec.get("rope_type", spec.get("type", "default")) for spec in specs]
    scaled = [kind for kind in kinds if kind != "default"]
    if scaled:
        raise hf.refuse("partial_rotary_factor", factor,
                        f"Gemma rotates whole heads; with {scaled[0]!r} RoPE scaling transformers cannot run it either")
    return _without_key(data, "partial_rotary_factor")


def _without_key(mapping: dict[str, Any], key: str) -> dict[str, Any]:
    """``mapping`` and the mappings inside it, without ``key``.

    Example:
        >>> _without_key({"a": 1, "b": {"a": 2, "c": 3}}, "a")
        {'b': {'c': 3}}
    """
    return {k: _without_key(v, key) if isinstance(v, dict) else v for k, v in mapping.items() if k != key}


def _activation(hf: HFConfig, variant: Variant) -> str:
    """The MLP's activation; Gemma's legacy "gelu" means the tanh approximation (transformers
    rewrites it so), while Gemma 2 and 3 take "gelu" literally."""
    if variant.legacy_gelu_is_tanh and hf.get(variant.activation_field) == "gelu":
        return "gelu_new"
    return hf.activation(variant.activation_field)


def _soft_cap(hf: HFConfig, field_name: str) -> Optional[float]:
    """A soft-cap value (None: not capped); zero or negative would divide by zero in transformers."""
    cap = hf.get(field_name)
    if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
        raise hf.refuse(field_name, cap, "a soft-cap must be a positive number or null")
    return None if cap is None else float(cap)


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str) -> dict[str, Tensor]:
    """Reads every tensor the model needs, renamed to ours, norm gains as 1 + w; a missing or
    mis-shaped one is a ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-gemma3")), cfg,
        ...                           "Gemma3ForCausalLM")                               # doctest: +SKIP
        >>> tensors["blocks.0.attn.q_norm.w"].shape                                     # doctest: +SKIP
        torch.Size([6, 8])
    """
    variant = VARIANTS[architecture]
    V, D = cfg.d_vocab, cfg.d_model
    out = {"embed.W_E": ckpt.take("model.embed_tokens.weight", (V, D)),
           "ln_final.w": _gain(ckpt.take("model.norm.weight", (D,)))}
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    for layer in range(cfg.n_layers):
        out.update(_block(ckpt, cfg, variant, layer))
    return out


# HF norm name -> ours, per block.
_PRE_NORMS = {"input_layernorm": "ln1", "post_attention_layernorm": "ln2"}
_SANDWICH_NORMS = {"input_layernorm": "ln1", "post_attention_layernorm": "ln1_post",
                   "pre_feedforward_layernorm": "ln2", "post_feedforward_layernorm": "ln2_post"}


def _block(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, variant: Variant, layer: int) -> dict[str, Tensor]:
    """One layer's norms, attention (with Gemma 3's QK norms) and GeGLU MLP, in our names."""
    D, M, H, G, K = cfg.d_model, cfg.d_mlp, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head
    hf, ours = f"model.layers.{layer}", f"blocks.{layer}"
    norms = _SANDWICH_NORMS if variant.sandwich else (variant.pre_norms or _PRE_NORMS)
    out = {f"{ours}.{name}.w": _gain(ckpt.take(f"{hf}.{hf_name}.weight", (D,))) for hf_name, name in norms.items()}
    for proj, rows, cols in (("q", H * K, D), ("k", G * K, D), ("v", G * K, D), ("o", D, H * K)):
        name = proj.upper()
        out[f"{ours}.attn._W_{name}_lin"] = ckpt.take(f"{hf}.self_attn.{proj}_proj.weight", (rows, cols))
        if cfg.attn_bias:
            bias_name = f"{ours}.attn.b_O" if proj == "o" else f"{ours}.attn._b_{name}_lin"
            out[bias_name] = ckpt.take(f"{hf}.self_attn.{proj}_proj.bias", (rows,))
    if variant.qk_norm:  # one [K] gain for all heads; ours has one per head
        for proj, n in (("q", H), ("k", G)):
            gain_K = _gain(ckpt.take(f"{hf}.self_attn.{proj}_norm.weight", (K,)))
            out[f"{ours}.attn.{proj}_norm.w"] = gain_K.expand(n, K).clone()
    for proj, name, shape in (("gate", "gate", (M, D)), ("up", "in", (M, D)), ("down", "out", (D, M))):
        out[f"{ours}.mlp._W_{name}_lin"] = ckpt.take(f"{hf}.mlp.{proj}_proj.weight", shape)
    return out


def _gain(w: Tensor) -> Tensor:
    """Gemma's RMSNorm multiplies by (1 + w), computed in float32; ours multiplies by its gain.
    Kept in float32 here: a float32 load keeps 1 + w exact, a bf16 one rounds it once."""
    return w.float() + 1.0


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={
        "GemmaForCausalLM": ("gemma", "Gemma (2B, 7B), CodeGemma"),
        "Gemma2ForCausalLM": ("gemma2", "Gemma 2"),
        "Gemma3ForCausalLM": ("gemma3_text", "Gemma 3, text-only checkpoints (e.g. gemma-3-1b)"),
        "VaultGemmaForCausalLM": ("vaultgemma", "VaultGemma (Gemma 2's attention, two norms per block)"),
    },
    model_config=model_config,
    convert_tensors=convert_tensors,
    # RoPE's inverse frequencies are recomputed, never read; some exports still carry them.
    ignored_tensors=re.compile(r".*rotary_emb\.\w*inv_freq$"),
),)
