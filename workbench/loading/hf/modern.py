"""Modern Llama-like decoders in HF format: Granite, Helium, Ministral, Ministral 3, Seed-OSS, OLMo 3,
EXAONE 4, HunYuan (dense), ERNIE 4.5, GLM, GLM-4, Cohere, Cohere 2, Arcee, Nemotron, Apertus and InternLM3.

Each is ``llama``'s decoder (RMSNorm, RoPE, grouped-query attention, a SwiGLU MLP, the same tensor
names) with different config values, so each is one ``llama.Variant`` in the table below, read by
``llama``'s own ``model_config`` and ``convert_tensors`` (read off transformers 5.24's ``modeling_*.py``):

    Granite     embedding_multiplier (embed_scale), attention_multiplier (the score scale, 1 / attn_scale),
                logits_scaling (logits divided by it: logits_scale); residual_multiplier (each sublayer's
                output times it) folded into W_O, b_O, W_out and b_out
    Helium      RoPE on adjacent pairs; o_proj never biased
    Ministral   sliding windows on the layers ``layer_types`` names (default: all, when a window is set)
    Ministral 3 queries scaled per position after RoPE (``rope_parameters.llama_4_scaling_beta``)
    Seed-OSS    q/k/v biases (attention_bias) and the o_proj bias (attention_out_bias) switched apart
    OLMo 3      OLMo 2 plus sliding windows (default: all layers but every 4th)
    EXAONE 4    norms after the sublayers (as OLMo 2), a per-head QK norm, sliding windows (default:
                all but every ``sliding_window_pattern``-th layer) and no RoPE on the full layers
    HunYuan     per-head QK norm after RoPE (query_layernorm / key_layernorm); a ``dynamic`` RoPE with a
                fixed ``alpha`` is the plain RoPE of base theta * alpha^(d / (d - 2))
    ERNIE 4.5   RoPE on adjacent pairs; use_bias on every projection
    GLM         one fused gate_up_proj; RoPE on adjacent pairs of the first half of each head
    GLM-4       GLM with a norm before and after each sublayer (``norm_placement="sandwich"``)
    Cohere      attention and MLP in parallel on one bias-free LayerNorm (ln2 a copy of ln1), RoPE on
                adjacent pairs, logits times logit_scale, a LayerNorm QK norm with a gain per head
    Cohere 2    Cohere plus sliding windows (default: all but every 4th layer), RoPE on the sliding layers only
    Arcee       an MLP without a gate: down(relu(up x)^2)
    Nemotron    the same MLP; LayerNorm1P (gains stored as w, used as 1 + w: folded in); partial rotary
    Apertus     the same MLP with xIELU (its scalars per layer, mlp.act_fn.*); a per-head QK norm; its
                norms are attention_layernorm / feedforward_layernorm
    InternLM3   remote-code checkpoints: q/k/v biases (qkv_bias), o_proj and MLP biases (bias)
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Optional

from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf import llama
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig
from workbench.loading.hf.llama import Variant


def granite_multipliers(hf: HFConfig) -> dict[str, Any]:
    """Three of Granite's multipliers as ModelConfig values (scores are q.k * attention_multiplier); the
    fourth, residual_multiplier, is folded into the weights (``convert_tensors``), checked here before any is read.
    Shared by Granite and GraniteMoE (``moe_families``).

    Example:
        >>> from workbench.loading.hf.config import HFConfig
        >>> granite_multipliers(HFConfig({"embedding_multiplier": 12.0, "attention_multiplier": 0.5,
        ...                                "logits_scaling": 8.0}, "config.json"))
        {'embed_scale': 12.0, 'attn_scale': 2.0, 'logits_scale': 0.125}
    """
    multiplier = hf.get("residual_multiplier", 1.0)
    if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)):
        raise hf.refuse("residual_multiplier", multiplier, "expected a number")
    return {"embed_scale": float(hf.get("embedding_multiplier", 1.0)),
            "attn_scale": 1.0 / float(hf.get("attention_multiplier", 1.0)),
            "logits_scale": 1.0 / float(hf.get("logits_scaling", 1.0))}


# Architectures whose every attention and MLP output is multiplied by a config value before the residual
# add (Granite's residual_multiplier), and that field: a pure reparametrisation of a pre-norm block, folded
# into W_O, b_O, W_out and b_out on loading, so the per-head results and neuron contributions (and the
# weight-based reads of them) sum to exactly what joins the residual stream.
# GraniteMoE's experts (and shared expert) are folded the same way: the mixture is linear in each W_out.
_FOLDED_OUTPUT_SCALES = {"GraniteForCausalLM": "residual_multiplier", "GraniteMoeForCausalLM": "residual_multiplier",
                         "GraniteMoeSharedForCausalLM": "residual_multiplier"}
_OUTPUT_WEIGHTS = re.compile(r"blocks\.\d+\.(attn\._W_O_lin|attn\.b_O|mlp\.(shared\.)?_W_out_lin|mlp\.(shared\.)?b_out)")


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str,
                    variants: Optional[dict[str, Variant]] = None) -> dict[str, Tensor]:
    """``llama.convert_tensors`` over this module's table (or ``variants``: ``moe_families``'s), with
    Granite's residual_multiplier folded into the sublayers' output weights and biases.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-granite")), cfg,
        ...                           "GraniteForCausalLM")                           # doctest: +SKIP
    """
    tensors = llama.convert_tensors(ckpt, cfg, architecture, variants=variants or VARIANTS)
    field = _FOLDED_OUTPUT_SCALES.get(architecture)
    if field is None:
        return tensors
    # The config model_config read (the multiplier is not a ModelConfig field).
    scale = float(HFConfig(ckpt.config_data(), ckpt.source).get(field, 1.0))
    return {name: t * scale if scale != 1.0 and _OUTPUT_WEIGHTS.fullmatch(name) else t for name, t in tensors.items()}


def _default_layer_types(rule):
    """A ``prepare`` that fills ``layer_types`` (when the config.json has none) as transformers'
    config does: ``rule(data, layer) -> is the layer sliding``."""

    def prepare(data: dict[str, Any]) -> dict[str, Any]:
        if data.get("layer_types") is None:
            n_layers = int(data.get("num_hidden_layers", 0))
            data["layer_types"] = ["sliding_attention" if rule(data, i) else "full_attention" for i in range(n_layers)]
        return data

    return prepare


def _exaone4_layers(data: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4: sliding on all but every ``sliding_window_pattern``-th layer; with a window, the full
    layers have no RoPE (written as SmolLM3's ``no_rope_layers``, 0 = none)."""
    window, pattern = data.get("sliding_window"), data.get("sliding_window_pattern", 4)
    if data.get("layer_types") is None and window is not None:
        n_layers = int(data.get("num_hidden_layers", 0))
        data["layer_types"] = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                               for i in range(n_layers)]
    if window is None:  # transformers' attention then has no window and RoPE on every layer, whatever layer_types says
        data["layer_types"] = ["full_attention"] * int(data.get("num_hidden_layers", 0))
    kinds = data["layer_types"]
    data["no_rope_layers"] = [int(window is None or kind == "sliding_attention") for kind in kinds]
    return data


def hunyuan_rope(data: dict[str, Any]) -> dict[str, Any]:
    """HunYuan's ``dynamic`` RoPE with an ``alpha`` is static: the plain RoPE of a stretched base,
    theta * alpha ** (head_dim / (head_dim - 2)). Shared by HunYuan dense and MoE (``moe_families``).

    Example:
        >>> hunyuan_rope({"hidden_size": 64, "num_attention_heads": 4,       # head_dim 16: 10000 * 2 ** (16 / 14)
        ...               "rope_scaling": {"type": "dynamic", "alpha": 2.0}, "rope_theta": 10000.0})["rope_parameters"]
        {'rope_type': 'default', 'rope_theta': 22081.79...}
    """
    params = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
    alpha = params.get("alpha")
    if params.get("rope_type", params.get("type")) == "dynamic" and alpha:
        head_dim = int(data.get("head_dim") or int(data["hidden_size"]) // int(data["num_attention_heads"]))
        theta = float(params.get("rope_theta", data.get("rope_theta", 10000.0)))
        data["rope_parameters"] = {"rope_type": "default", "rope_theta": theta * float(alpha) ** (head_dim / (head_dim - 2))}
        data.pop("rope_scaling", None)
    return data


def _ministral3_query_scale(hf: HFConfig) -> dict[str, Any]:
    """Ministral 3 scales every query by 1 + beta * log(1 + floor(position / original context))."""
    params = hf.get("rope_parameters", {})
    beta, length = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if beta is None or length is None:
        raise hf.refuse("rope_parameters.llama_4_scaling_beta", beta, "Ministral 3 scales its queries by it over "
                        "rope_parameters.original_max_position_embeddings: both are required")
    return {"query_scale_beta": float(beta), "query_scale_length": int(length)}


_OLMO2_LIKE = dict(qkv_bias_field="attention_bias", norm_eps=1e-5, norm_placement="sublayer_output")
_GLM_DEFAULTS = {"num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1.5625e-7, "attention_bias": True,
                 "partial_rotary_factor": 0.5}
_GLM = dict(qkv_bias_field="attention_bias", o_proj_bias=False, fused_gate_up=True, rotary_adjacent_pairs=True,
            partial_rotary=True)


def _cohere_fields(hf: HFConfig) -> dict[str, Any]:
    """Cohere: attention and MLP in parallel on one norm, logits times ``logit_scale``, QK norm when asked."""
    return {"parallel_attn_mlp": True, "logits_scale": float(hf.get("logit_scale", 0.0625)),
            "qk_norm": "head" if hf.get("use_qk_norm", False) else None}


def _cohere2_layers(data: dict[str, Any]) -> dict[str, Any]:
    """Cohere 2: sliding on all but every ``sliding_window_pattern``-th layer; RoPE on the sliding layers only."""
    if data.get("layer_types") is None:
        pattern, n_layers = int(data.get("sliding_window_pattern", 4)), int(data.get("num_hidden_layers", 0))
        data["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    window = data.get("sliding_window")
    if window is None:  # transformers' attention then has no window, and no RoPE on any layer
        data["layer_types"] = ["full_attention"] * len(data["layer_types"])
    data["no_rope_layers"] = [int(window is not None and kind == "sliding_attention") for kind in data["layer_types"]]
    return data


_COHERE = dict(qkv_bias_field="attention_bias", normalization="LN", norm_eps_field="layer_norm_eps", norm_eps=1e-5,
               rotary_adjacent_pairs=True, qk_norm_gains_per_head=True,
               layer_norms=(("ln1", "input_layernorm"), ("ln2", "input_layernorm")),  # one norm for both sublayers
               extra_fields=_cohere_fields)
_APERTUS_ROPE = {"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0, "original_max_position_embeddings": 8192,
                 "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_COHERE_DEFAULTS = {"tie_word_embeddings": True, "logit_scale": 0.0625}
_MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16384,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}

VARIANTS = {
    "GraniteForCausalLM": Variant(qkv_bias_field="attention_bias", mlp_bias_field="mlp_bias",
                                  extra_fields=granite_multipliers),
    "HeliumForCausalLM": Variant(qkv_bias_field="attention_bias", o_proj_bias=False, mlp_bias_field="mlp_bias",
                                 rotary_adjacent_pairs=True, norm_eps=1e-8,
                                 defaults={"num_key_value_heads": 20, "head_dim": 128}),
    "MinistralForCausalLM": Variant(sliding="layer_types", defaults={"num_key_value_heads": 8, "sliding_window": 4096},
                                    prepare=_default_layer_types(lambda data, i: data.get("sliding_window") is not None)),
    "Ministral3ForCausalLM": Variant(sliding="every_layer", norm_eps=1e-5, extra_fields=_ministral3_query_scale,
                                     defaults={"num_key_value_heads": 8, "head_dim": 128,
                                               "rope_parameters": _MINISTRAL3_ROPE}),
    "SeedOssForCausalLM": Variant(qkv_bias_field="attention_bias", o_bias_field="attention_out_bias",
                                  mlp_bias_field="mlp_bias",
                                  defaults={"num_key_value_heads": 8, "head_dim": 128, "attention_bias": True}),
    "Olmo3ForCausalLM": Variant(**_OLMO2_LIKE, qk_norm="projection", sliding="layer_types",
                                defaults={"sliding_window": 4096},
                                prepare=_default_layer_types(lambda data, i: (i + 1) % 4 != 0)),
    "Exaone4ForCausalLM": Variant(norm_eps=1e-5, norm_placement="sublayer_output", qk_norm="head", sliding="layer_types",
                                  nope_layers=True, prepare=_exaone4_layers,
                                  defaults={"num_key_value_heads": 32, "sliding_window": 4096,
                                            "sliding_window_pattern": 4}),
    "HunYuanDenseV1ForCausalLM": Variant(qkv_bias_field="attention_bias", norm_eps=1e-5, qk_norm="head",
                                         qk_norm_names=("query_layernorm", "key_layernorm"), prepare=hunyuan_rope,
                                         extra_fields=lambda hf: {"qk_norm_after_rotary": True}),
    "Ernie4_5ForCausalLM": Variant(qkv_bias_field="use_bias", mlp_bias_field="use_bias", rotary_adjacent_pairs=True,
                                   norm_eps=1e-5, defaults={"num_key_value_heads": 2, "head_dim": 128,
                                                            "tie_word_embeddings": True}),
    "GlmForCausalLM": Variant(**_GLM, defaults=_GLM_DEFAULTS),
    "Glm4ForCausalLM": Variant(**_GLM, norm_placement="sandwich", defaults=_GLM_DEFAULTS),
    "CohereForCausalLM": Variant(**_COHERE, defaults=_COHERE_DEFAULTS),
    "Cohere2ForCausalLM": Variant(**_COHERE, sliding="layer_types", nope_layers=True, prepare=_cohere2_layers,
                                  defaults={**_COHERE_DEFAULTS, "sliding_window": 4096}),
    "ArceeForCausalLM": Variant(qkv_bias_field="attention_bias", mlp_bias_field="mlp_bias", gated_mlp=False,
                                norm_eps=1e-5),
    "NemotronForCausalLM": Variant(qkv_bias_field="attention_bias", mlp_bias_field="mlp_bias", gated_mlp=False,
                                   partial_rotary=True, normalization="LN", norm_bias=True, norm_gain_offset=1.0,
                                   norm_eps_field="norm_eps", norm_eps=1e-5, defaults={"partial_rotary_factor": 0.5}),
    "ApertusForCausalLM": Variant(qkv_bias_field="attention_bias", gated_mlp=False, norm_eps=1e-5, qk_norm="head",
                                  layer_norms=(("ln1", "attention_layernorm"), ("ln2", "feedforward_layernorm")),
                                  defaults={"hidden_act": "xielu", "rope_parameters": _APERTUS_ROPE}),
    "InternLM3ForCausalLM": Variant(qkv_bias_field="qkv_bias", o_bias_field="bias", mlp_bias_field="bias"),
}

# Architectures transformers builds that this workbench refuses, and why (loader.py names the reason).
REFUSED = {
    "Gemma4ForCausalLM": "Gemma 4 needs components the workbench does not have: per-layer input embeddings "
                         "(hidden_size_per_layer_input), layers reusing another layer's keys and values "
                         "(num_kv_shared_layers), gain-free RMS-normed values, full-attention layers with their own "
                         "head size and keys as values (global_head_dim, attention_k_eq_v), a per-layer output "
                         "scalar and an optional mixture-of-experts block beside the MLP",
    "BitNetForCausalLM": "BitNet b1.58 needs components the workbench does not have yet: ternary BitLinear weights as "
                         "stored (packed, with their scales), per-token int8 quantisation of every linear layer's "
                         "input, and RMS norms on the attention output and the MLP's hidden activations",
}

# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={
        "GraniteForCausalLM": ("granite", "IBM Granite 3.x dense (embedding, attention, residual, logits multipliers)"),
        "HeliumForCausalLM": ("helium", "Kyutai Helium"),
        "MinistralForCausalLM": ("ministral", "Ministral (sliding windows per layer)"),
        "Ministral3ForCausalLM": ("ministral3", "Ministral 3 (yarn, position-scaled queries)"),
        "SeedOssForCausalLM": ("seed_oss", "ByteDance Seed-OSS"),
        "Olmo3ForCausalLM": ("olmo3", "OLMo 3 (sliding windows)"),
        "Exaone4ForCausalLM": ("exaone4", "EXAONE 4.0 (QK norm, norms after sublayers, NoPE full layers)"),
        "HunYuanDenseV1ForCausalLM": ("hunyuan_v1_dense", "Hunyuan dense (QK norm after RoPE, NTK alpha)"),
        "Ernie4_5ForCausalLM": ("ernie4_5", "ERNIE 4.5 dense"),
        "GlmForCausalLM": ("glm", "GLM-4-9B (partial rotary on adjacent pairs)"),
        "Glm4ForCausalLM": ("glm4", "GLM-4-0414 (sandwich norms, partial rotary on adjacent pairs)"),
        "CohereForCausalLM": ("cohere", "Command-R (parallel blocks, bias-free LayerNorm, logit scale, QK norm)"),
        "Cohere2ForCausalLM": ("cohere2", "Command R7B, Command A (sliding windows, NoPE full layers)"),
        "ArceeForCausalLM": ("arcee", "Arcee AFM (relu^2 without a gate)"),
        "NemotronForCausalLM": ("nemotron", "Nemotron-3/4, Minitron (relu^2, LayerNorm1P, partial rotary)"),
        "ApertusForCausalLM": ("apertus", "Swiss AI Apertus (xIELU, QK norm, llama3 RoPE)"),
        "InternLM3ForCausalLM": ("internlm3", "InternLM3 (remote-code configs: qkv_bias, bias)"),
    },
    model_config=partial(llama.model_config, variants=VARIANTS),
    convert_tensors=convert_tensors,
    ignored_tensors=re.compile(r".*rotary_emb\.inv_freq$"),
),)
