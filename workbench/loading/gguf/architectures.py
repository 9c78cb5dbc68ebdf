"""The GGUF architectures we read, as a table: for each ``general.architecture`` llama.cpp writes, the
transformers architecture whose family module (``hf/*.py``) does the real work, the metadata keys that
become its ``config.json`` fields, and where each transformers tensor sits in the file (``Rule``, with
the ``layouts`` layout that undoes what ``convert_hf_to_gguf.py`` did to it).

So a GGUF file is read as the HF checkpoint it was converted from: ``hf_config`` rebuilds config.json
from the metadata, ``tensor_sources`` maps every transformers tensor name onto GGUF tensors, and the
family's own ``model_config`` and ``convert_tensors`` map those onto ours. No family's math is written
twice, and nothing here branches on an architecture's name.

Metadata keys are ``{arch}.{key}`` (``llama.block_count``); ``COMMON_KEYS`` are the ones every
llama-like converter writes, each entry's ``keys`` add or rename fields (None drops one), ``fixed``
holds what llama.cpp hard-codes for the architecture (Gemma's activation), and ``derived`` computes
the few fields a converter stores another way (Gemma 2/3's query scale, Falcon's norm count).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

# GGUF metadata key (after "{arch}.") -> transformers config field, for llama-like configs.
COMMON_KEYS = {
    "block_count": "num_hidden_layers", "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "context_length": "max_position_embeddings", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}
# Keys that must be positive integers when present (checked before anything divides by them).
POSITIVE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                 "attention.head_count_kv", "context_length", "attention.key_length", "expert_used_count",
                 "expert_feed_forward_length")
REQUIRED_KEYS = ("block_count", "embedding_length", "attention.head_count", "context_length")


@dataclass(frozen=True)
class Rule:
    """transformers' tensor ``hf`` (without .weight/.bias; ``{l}`` the layer) is GGUF's ``gguf`` tensor(s),
    stored in ``layout``; ``when``: only in layers that also hold that GGUF tensor (Falcon's second norm);
    ``absent_zero``: a missing bias reads as zeros (llama's attention output, biased only in some files)."""

    gguf: str | tuple[str, ...]
    hf: str
    layout: str = "as_is"
    when: Optional[str] = None
    absent_zero: bool = False
    suffixes: tuple[str, ...] = (".weight", ".bias")


@dataclass(frozen=True)
class GGUFArchitecture:
    """One ``general.architecture``: what it covers and how it reads as a transformers checkpoint."""

    hf_architecture: str
    models: str
    rules: tuple[Rule, ...]
    keys: dict[str, Optional[str]] = field(default_factory=dict)  # added to / overriding COMMON_KEYS
    fixed: dict[str, Any] = field(default_factory=dict)
    derived: Optional[Callable[["Metadata"], dict[str, Any]]] = None
    # The transformers architecture when the metadata picks one (llama's Mixtral-style experts, DeepSeek V2/V3).
    choose: Optional[Callable[["Metadata"], str]] = None
    ignored: re.Pattern = re.compile(r"$^")  # GGUF tensors that are copies of ones read (passed over)
    head_dim_field: Optional[str] = "head_dim"  # where the head width goes (None: the config has none)
    partial_rotary: bool = True  # rope.dimension_count < head width means partial_rotary_factor (not DeepSeek's)
    layer_norm_field: Optional[str] = None  # where attention.layer_norm_epsilon goes (LayerNorm families)


class Metadata:
    """The file's metadata under one architecture's prefix, and its tensor names, for ``derived``."""

    def __init__(self, field: Callable[[str, Any], Any], arch: str, tensor_names: set[str]):
        self.field, self.arch, self.tensor_names = field, arch, tensor_names

    def get(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def has_tensor(self, name: str) -> bool:
        return name in self.tensor_names


# ---- the tensor names llama.cpp writes (gguf-py's MODEL_TENSORS), shared by the llama-like entries ----

def _layer(gguf: str, hf: str, layout: str = "as_is", **options: Any) -> Rule:
    return Rule(f"blk.{{l}}.{gguf}", f"model.layers.{{l}}.{hf}", layout, **options)


_EMBED = (Rule("token_embd", "model.embed_tokens"), Rule("output_norm", "model.norm"), Rule("output", "lm_head"))
_ATTENTION = tuple(_layer(g, f"self_attn.{h}") for g, h in
                   (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")))
_PERMUTED_ATTENTION = (_layer("attn_q", "self_attn.q_proj", "unpermute_q"), _layer("attn_k", "self_attn.k_proj", "unpermute_k"),
                       _layer("attn_v", "self_attn.v_proj"), _layer("attn_output", "self_attn.o_proj", absent_zero=True))
_QK_NORM = (_layer("attn_q_norm", "self_attn.q_norm"), _layer("attn_k_norm", "self_attn.k_norm"))
_PRE_NORMS = (_layer("attn_norm", "input_layernorm"), _layer("ffn_norm", "post_attention_layernorm"))
_GATED_MLP = tuple(_layer(g, f"mlp.{h}") for g, h in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"),
                                                       ("ffn_down", "down_proj")))
# Experts as transformers holds them in memory (hf.experts reads this "fused" spelling), shared expert beside.
_EXPERTS = (Rule(("blk.{l}.ffn_gate_exps.weight", "blk.{l}.ffn_up_exps.weight"),
                 "model.layers.{l}.mlp.experts.gate_up_proj", "stacked_rows", suffixes=("",)),
            Rule("blk.{l}.ffn_down_exps.weight", "model.layers.{l}.mlp.experts.down_proj", suffixes=("",)),
            _layer("ffn_gate_inp", "mlp.gate"))
_SHARED_EXPERT = (_layer("ffn_gate_inp_shexp", "mlp.shared_expert_gate"), _layer("ffn_gate_shexp", "mlp.shared_expert.gate_proj"),
                  _layer("ffn_up_shexp", "mlp.shared_expert.up_proj"), _layer("ffn_down_shexp", "mlp.shared_expert.down_proj"))
_LLAMA_LIKE = _EMBED + _ATTENTION + _PRE_NORMS + _GATED_MLP
_GEMMA_NORMS = (Rule("output_norm", "model.norm", "minus_one"), _layer("attn_norm", "input_layernorm", "minus_one"))
_GEMMA_SANDWICH = (_layer("post_attention_norm", "post_attention_layernorm", "minus_one"),
                   _layer("ffn_norm", "pre_feedforward_layernorm", "minus_one"),
                   _layer("post_ffw_norm", "post_feedforward_layernorm", "minus_one"))
_GEMMA_BASE = (Rule("token_embd", "model.embed_tokens"), Rule("output", "lm_head")) + _ATTENTION + _GATED_MLP + _GEMMA_NORMS


# ---- derived fields: what llama.cpp stores another way, or hard-codes ----

def _gemma_attention_scale(big_model_layers: int) -> Callable[[Metadata], dict[str, Any]]:
    """Gemma 2/3: llama.cpp scales scores by 1/sqrt(head_dim), except in the 27B model (known by its layer
    count), scaled by 1/sqrt(d_model / n_heads); ``attention.scale`` (when written) states it outright."""
    def derive(meta: Metadata) -> dict[str, Any]:
        scale = meta.get("attention.scale")
        if scale is not None:
            return {"query_pre_attn_scalar": 1.0 / float(scale) ** 2}
        d_model, n_heads = meta.get("embedding_length"), meta.get("attention.head_count")
        head_dim = meta.get("attention.key_length", d_model // n_heads)
        big = meta.get("block_count") == big_model_layers
        return {"query_pre_attn_scalar": d_model // n_heads if big else head_dim}
    return derive


def _gemma3(meta: Metadata) -> dict[str, Any]:
    """Gemma 3: every 6th layer global (llama.cpp's swa pattern), local layers at RoPE base 10000 unscaled."""
    return {**_gemma_attention_scale(62)(meta), "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0}


def _falcon(meta: Metadata) -> dict[str, Any]:
    """Falcon-40B/180B have a second per-layer norm (``attn_norm_2``); without it one norm feeds both."""
    return {"num_ln_in_parallel_attn": 2 if meta.has_tensor("blk.0.attn_norm_2.weight") else 1,
            "bias": meta.has_tensor("blk.0.attn_qkv.bias")}


def _biases(switch: str, probe: str = "blk.0.attn_q.bias") -> Callable[[Metadata], dict[str, Any]]:
    """A config switch read off the file: biases are there or not."""
    return lambda meta: {switch: meta.has_tensor(probe)}


def _deepseek_v3(meta: Metadata) -> bool:
    """V3's sigmoid routing: the gating function says so, or the routers' correction bias is there."""
    return meta.get("expert_gating_func", 1) == 2 or any(name.endswith("exp_probs_b.bias") for name in meta.tensor_names)


def _deepseek2(meta: Metadata) -> dict[str, Any]:
    """DeepSeek-V2/V3: the latent sizes. Files written since llama.cpp's MLA rewrite state the heads' own
    widths in ``key_length_mla`` / ``value_length_mla`` (``key_length`` is then the latent's) and one KV head;
    transformers' config has a KV head per query head. Routing as the converter records it."""
    rope = int(meta.get("rope.dimension_count"))
    key = int(meta.get("attention.key_length_mla", meta.get("attention.key_length")))
    groups = int(meta.get("expert_group_count", 1) or 1)
    sigmoid = _deepseek_v3(meta)
    return {"norm_topk_prob": bool(meta.get("expert_weights_norm", False)),  # written only when true
            "routed_scaling_factor": float(meta.get("expert_weights_scale", 1.0)),"qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope,
            "v_head_dim": int(meta.get("attention.value_length_mla", meta.get("attention.value_length"))),
            "q_lora_rank": meta.get("attention.q_lora_rank"), "num_key_value_heads": meta.get("attention.head_count"),
            "n_group": groups, "topk_group": int(meta.get("expert_group_used_count", groups) or groups),
            "scoring_func": "sigmoid" if sigmoid else "softmax",
            "topk_method": "noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy"}


def _moe(meta: Metadata) -> dict[str, Any]:
    return {"num_local_experts": meta.get("expert_count", 0), "attention_bias": meta.has_tensor("blk.0.attn_q.bias")}


# ---- the table ----

_LLAMA_RULES = _EMBED + _PERMUTED_ATTENTION + _PRE_NORMS + _GATED_MLP + _EXPERTS
_GPT2_LAYER = {"attn_norm": "ln_1", "ffn_norm": "ln_2", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GPT2_KEYS = {"block_count": "n_layer", "embedding_length": "n_embd", "attention.head_count": "n_head",
              "context_length": "n_positions", "feed_forward_length": "n_inner", "attention.head_count_kv": None,
              "rope.freq_base": None}

ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture(
        "LlamaForCausalLM", "Llama 1-3, SmolLM2, Mistral 7B, Mixtral (experts); Q/K rows un-permuted",
        _LLAMA_RULES, keys={"expert_used_count": "num_experts_per_tok"}, fixed={"hidden_act": "silu"},
        derived=_moe, choose=lambda meta: "MixtralForCausalLM" if meta.get("expert_count", 0) else "LlamaForCausalLM"),
    "qwen2": GGUFArchitecture(
        "Qwen2ForCausalLM", "Qwen2, Qwen2.5", _LLAMA_LIKE, fixed={"hidden_act": "silu", "use_sliding_window": False}),
    "qwen3": GGUFArchitecture(
        "Qwen3ForCausalLM", "Qwen3 (QK norm)", _LLAMA_LIKE + _QK_NORM,
        fixed={"hidden_act": "silu", "use_sliding_window": False}, derived=_biases("attention_bias")),
    "qwen2moe": GGUFArchitecture(
        "Qwen2MoeForCausalLM", "Qwen1.5-MoE, Qwen2-MoE (a sigmoid-gated shared expert)",
        _EMBED + _ATTENTION + _PRE_NORMS + _EXPERTS + _SHARED_EXPERT,
        keys={"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
              "expert_feed_forward_length": "moe_intermediate_size",
              "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
        fixed={"hidden_act": "silu", "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
               "use_sliding_window": False}, derived=_biases("qkv_bias")),
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeForCausalLM", "Qwen3-MoE (top-k weights renormalised, as llama.cpp computes them)",
        _EMBED + _ATTENTION + _QK_NORM + _PRE_NORMS + _EXPERTS,
        keys={"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
              "expert_feed_forward_length": "moe_intermediate_size"},
        fixed={"hidden_act": "silu", "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
               "use_sliding_window": False}, derived=_biases("attention_bias")),
    "gemma": GGUFArchitecture(
        "GemmaForCausalLM", "Gemma (2B, 7B), CodeGemma; norm gains stored as 1 + w",
        _GEMMA_BASE + (_layer("ffn_norm", "post_attention_layernorm", "minus_one"),),
        fixed={"hidden_act": "gelu_pytorch_tanh"}),
    "gemma2": GGUFArchitecture(
        "Gemma2ForCausalLM", "Gemma 2 (soft caps, alternating windows); norm gains stored as 1 + w",
        _GEMMA_BASE + _GEMMA_SANDWICH,
        keys={"attention.sliding_window": "sliding_window", "attn_logit_softcapping": "attn_logit_softcapping",
              "final_logit_softcapping": "final_logit_softcapping"},
        fixed={"hidden_activation": "gelu_pytorch_tanh"}, derived=_gemma_attention_scale(46)),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM", "Gemma 3 text (QK norm, 5 local : 1 global layers, linear RoPE scaling on global ones)",
        _GEMMA_BASE + _GEMMA_SANDWICH + tuple(_layer(g, f"self_attn.{h}", "minus_one") for g, h in
                                               (("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm"))),
        keys={"attention.sliding_window": "sliding_window", "final_logit_softcapping": "final_logit_softcapping"},
        fixed={"hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None}, derived=_gemma3),
    "phi3": GGUFArchitecture(
        "Phi3ForCausalLM", "Phi-3 4k, Phi-4 (fused QKV and gate/up; longrope files are refused)",
        _EMBED + _PRE_NORMS + (_layer("attn_qkv", "self_attn.qkv_proj"), _layer("attn_output", "self_attn.o_proj"),
                               _layer("ffn_up", "mlp.gate_up_proj"), _layer("ffn_down", "mlp.down_proj")),
        keys={"attention.sliding_window": "sliding_window"}, fixed={"hidden_act": "silu"}),
    "gpt2": GGUFArchitecture(
        "GPT2LMHeadModel", "GPT-2 (Conv1D weights stored transposed)",
        (Rule("token_embd", "transformer.wte"), Rule("position_embd", "transformer.wpe"),
         Rule("output_norm", "transformer.ln_f"), Rule("output", "lm_head"))
        + tuple(Rule(f"blk.{{l}}.{g}", f"transformer.h.{{l}}.{h}", "transposed") for g, h in _GPT2_LAYER.items()),
        keys=_GPT2_KEYS, fixed={"activation_function": "gelu_new"}, head_dim_field=None,
        layer_norm_field="layer_norm_epsilon"),
    "starcoder": GGUFArchitecture(
        "GPTBigCodeForCausalLM", "StarCoder, StarCoderBase, SantaCoder (multi-query)",
        (Rule("token_embd", "transformer.wte"), Rule("position_embd", "transformer.wpe"),
         Rule("output_norm", "transformer.ln_f"), Rule("output", "lm_head"))
        + tuple(Rule(f"blk.{{l}}.{g}", f"transformer.h.{{l}}.{h}", "qkv_grouped" if g == "attn_qkv" else "as_is")
                for g, h in _GPT2_LAYER.items()),
        keys=_GPT2_KEYS, fixed={"activation_function": "gelu_pytorch_tanh", "scale_attn_weights": True},
        derived=lambda meta: {"multi_query": meta.get("attention.head_count_kv", 1) == 1}, head_dim_field=None,
        layer_norm_field="layer_norm_epsilon"),
    "starcoder2": GGUFArchitecture(
        "Starcoder2ForCausalLM", "StarCoder2", _EMBED + _ATTENTION + _PRE_NORMS
        + (_layer("ffn_up", "mlp.c_fc"), _layer("ffn_down", "mlp.c_proj")),
        fixed={"hidden_act": "gelu_pytorch_tanh", "sliding_window": None}, derived=_biases("use_bias"),
        head_dim_field=None, layer_norm_field="norm_epsilon"),
    "falcon": GGUFArchitecture(
        "FalconForCausalLM", "Falcon-7B, 40B, 180B, Falcon2-11B (fused QKV back in per-group order)",
        (Rule("token_embd", "transformer.word_embeddings"), Rule("output_norm", "transformer.ln_f"),
         Rule("output", "lm_head"),
         # Falcon-40B's attention norm is attn_norm_2 and its MLP norm attn_norm (gguf-py's tensor map)
         Rule("blk.{l}.attn_norm_2", "transformer.h.{l}.ln_attn"),
         Rule("blk.{l}.attn_norm", "transformer.h.{l}.ln_mlp", when="blk.{l}.attn_norm_2.weight"),
         Rule("blk.{l}.attn_norm", "transformer.h.{l}.input_layernorm"),
         Rule("blk.{l}.attn_qkv", "transformer.h.{l}.self_attention.query_key_value", "qkv_grouped"),
         Rule("blk.{l}.attn_output", "transformer.h.{l}.self_attention.dense"),
         Rule("blk.{l}.ffn_up", "transformer.h.{l}.mlp.dense_h_to_4h"),
         Rule("blk.{l}.ffn_down", "transformer.h.{l}.mlp.dense_4h_to_h")),
        keys={"attention.head_count_kv": "num_kv_heads", "feed_forward_length": "ffn_hidden_size"},
        fixed={"new_decoder_architecture": True, "parallel_attn": True, "alibi": False, "activation": "gelu"},
        derived=_falcon, head_dim_field=None, layer_norm_field="layer_norm_epsilon"),
    "deepseek2": GGUFArchitecture(
        "DeepseekV2ForCausalLM", "DeepSeek-V2, V2-Lite, V3, R1 (latent attention; kv_b whole or split per head; "
        "YaRN files are refused)",
        _EMBED + _PRE_NORMS + _GATED_MLP + _EXPERTS + tuple(_layer(g, f"mlp.shared_experts.{h}") for g, h in (
            ("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"), ("ffn_down_shexp", "down_proj")))
        + tuple(_layer(g, f"self_attn.{h}") for g, h in (
            ("attn_q", "q_proj"), ("attn_q_a", "q_a_proj"), ("attn_q_a_norm", "q_a_layernorm"), ("attn_q_b", "q_b_proj"),
            ("attn_kv_a_mqa", "kv_a_proj_with_mqa"), ("attn_kv_a_norm", "kv_a_layernorm"), ("attn_output", "o_proj")))
        + (_layer("attn_kv_b", "self_attn.kv_b_proj", when="blk.{l}.attn_kv_b.weight"),
           Rule(("blk.{l}.attn_k_b.weight", "blk.{l}.attn_v_b.weight"), "model.layers.{l}.self_attn.kv_b_proj.weight",
                "kv_b_joined", suffixes=("",)),
           Rule("blk.{l}.exp_probs_b.bias", "model.layers.{l}.mlp.gate.e_score_correction_bias", suffixes=("",))),
        keys={"leading_dense_block_count": "first_k_dense_replace", "attention.kv_lora_rank": "kv_lora_rank",
              "expert_feed_forward_length": "moe_intermediate_size", "expert_count": "n_routed_experts",
              "expert_used_count": "num_experts_per_tok", "expert_shared_count": "n_shared_experts"},
        fixed={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}, derived=_deepseek2,
        choose=lambda meta: "DeepseekV3ForCausalLM" if _deepseek_v3(meta) else "DeepseekV2ForCausalLM",
        ignored=re.compile(r"blk\.\d+\.attn_[kv]_b\.weight"), head_dim_field=None, partial_rotary=False),
    "granite": GGUFArchitecture(
        "GraniteForCausalLM", "IBM Granite 3.x dense (multipliers; Q/K rows un-permuted)",
        _EMBED + _PERMUTED_ATTENTION + _PRE_NORMS + _GATED_MLP,
        keys={"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
              "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"},
        fixed={"hidden_act": "silu"}, derived=_biases("attention_bias")),
    "arcee": GGUFArchitecture(
        "ArceeForCausalLM", "Arcee AFM (relu^2 without a gate; Q/K rows un-permuted)",
        _EMBED + _PERMUTED_ATTENTION + _PRE_NORMS + (_layer("ffn_up", "mlp.up_proj"), _layer("ffn_down", "mlp.down_proj")),
        fixed={"hidden_act": "relu2"}, derived=_biases("attention_bias")),
    "ernie4_5": GGUFArchitecture(
        "Ernie4_5ForCausalLM", "ERNIE 4.5 dense (RoPE on adjacent pairs, as stored)", _LLAMA_LIKE,
        fixed={"hidden_act": "silu"}, derived=_biases("use_bias")),
    "nemotron": GGUFArchitecture(
        "NemotronForCausalLM", "Nemotron-3/4, Minitron (LayerNorm1P gains stored as 1 + w)",
        (Rule("token_embd", "model.embed_tokens"), Rule("output", "lm_head"), Rule("output_norm", "model.norm", "minus_one"),
         _layer("attn_norm", "input_layernorm", "minus_one"), _layer("ffn_norm", "post_attention_layernorm", "minus_one"),
         _layer("ffn_up", "mlp.up_proj"), _layer("ffn_down", "mlp.down_proj")) + _ATTENTION,
        fixed={"hidden_act": "relu2"}, derived=_biases("attention_bias"), layer_norm_field="norm_eps"),
    "stablelm": GGUFArchitecture(
        "StableLmForCausalLM", "StableLM-3B-4E1T, StableLM 2 (without per-head QK norm)",
        _EMBED + _ATTENTION + _PRE_NORMS + _GATED_MLP, fixed={"hidden_act": "silu", "qk_layernorm": False},
        derived=lambda meta: {"use_parallel_residual": not meta.has_tensor("blk.0.ffn_norm.weight"),
                              "use_qkv_bias": meta.has_tensor("blk.0.attn_q.bias")},
        layer_norm_field="layer_norm_eps"),
    "phi2": GGUFArchitecture(
        "PhiForCausalLM", "Phi-1, Phi-1.5, Phi-2 (partial rotary, parallel block)",
        (Rule("token_embd", "model.embed_tokens"), Rule("output_norm", "model.final_layernorm"), Rule("output", "lm_head"),
         _layer("attn_norm", "input_layernorm"), _layer("attn_output", "self_attn.dense"), _layer("ffn_up", "mlp.fc1"),
         _layer("ffn_down", "mlp.fc2")) + _ATTENTION[:3],
        fixed={"hidden_act": "gelu_new", "qk_layernorm": False}, layer_norm_field="layer_norm_eps"),
    "gptneox": GGUFArchitecture(
        "GPTNeoXForCausalLM", "GPT-NeoX, Pythia (fused QKV back in per-head order)",
        (Rule("token_embd", "gpt_neox.embed_in"), Rule("output_norm", "gpt_neox.final_layer_norm"),
         Rule("output", "embed_out"))
        + tuple(Rule(f"blk.{{l}}.{g}", f"gpt_neox.layers.{{l}}.{h}", "qkv_grouped" if g == "attn_qkv" else "as_is")
                for g, h in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                             ("attn_qkv", "attention.query_key_value"), ("attn_output", "attention.dense"),
                             ("ffn_up", "mlp.dense_h_to_4h"), ("ffn_down", "mlp.dense_4h_to_h"))),
        keys={"use_parallel_residual": "use_parallel_residual", "rope.freq_base": "rotary_emb_base"},
        fixed={"hidden_act": "gelu"}, layer_norm_field="layer_norm_eps", head_dim_field=None,
        derived=lambda meta: {"rotary_pct": int(meta.get("rope.dimension_count")) / heads_of(meta)[2]}),
    "bloom": GGUFArchitecture(
        "BloomForCausalLM", "BLOOM, BLOOMZ (ALiBi; fused QKV back in per-head order)",
        (Rule("token_embd", "transformer.word_embeddings"), Rule("token_embd_norm", "transformer.word_embeddings_layernorm"),
         Rule("output_norm", "transformer.ln_f"), Rule("output", "lm_head"))
        + tuple(Rule(f"blk.{{l}}.{g}", f"transformer.h.{{l}}.{h}", "qkv_grouped" if g == "attn_qkv" else "as_is")
                for g, h in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                             ("attn_qkv", "self_attention.query_key_value"), ("attn_output", "self_attention.dense"),
                             ("ffn_up", "mlp.dense_h_to_4h"), ("ffn_down", "mlp.dense_4h_to_h"))),
        keys={"block_count": "n_layer", "attention.head_count": "n_head", "context_length": "seq_length",
              "feed_forward_length": None, "rope.freq_base": None, "attention.head_count_kv": None},
        layer_norm_field="layer_norm_epsilon", head_dim_field=None, partial_rotary=False),
    "olmo": GGUFArchitecture(
        "OlmoForCausalLM", "OLMo (parameter-free LayerNorm; Q/K rows un-permuted)",
        (Rule("token_embd", "model.embed_tokens"), Rule("output", "lm_head")) + _PERMUTED_ATTENTION[:3]
        + (_layer("attn_output", "self_attn.o_proj"),) + _GATED_MLP,
        keys={"attention.clamp_kqv": "clip_qkv"}, fixed={"hidden_act": "silu"}),
    "olmo2": GGUFArchitecture(
        "Olmo2ForCausalLM", "OLMo 2 (norms after each sublayer, QK norm over the projection)",
        _EMBED + _ATTENTION + _QK_NORM + _GATED_MLP
        + (_layer("post_attention_norm", "post_attention_layernorm"), _layer("post_ffw_norm", "post_feedforward_layernorm")),
        fixed={"hidden_act": "silu"}),
}


def key_map(spec: GGUFArchitecture) -> dict[str, str]:
    """The metadata keys this architecture reads and the config fields they become.

    Example:
        >>> key_map(ARCHITECTURES["gpt2"])["embedding_length"]
        'n_embd'
    """
    keys = {**COMMON_KEYS, **spec.keys}
    if spec.layer_norm_field is not None:
        keys["attention.layer_norm_epsilon"] = spec.layer_norm_field
    return {key: hf for key, hf in keys.items() if hf is not None}


def heads_of(meta: Metadata) -> tuple[int, int, int]:
    """(n_heads, n_kv_heads, d_head) as the file states them (checked positive by the caller).

    Example:
        >>> meta = Metadata(lambda key, default=None: {"x.embedding_length": 64, "x.attention.head_count": 4}.get(key, default), "x", set())
        >>> heads_of(meta)
        (4, 4, 16)
    """
    n_heads = int(meta.get("attention.head_count"))
    n_kv = int(meta.get("attention.head_count_kv", n_heads))
    return n_heads, n_kv, int(meta.get("attention.key_length", int(meta.get("embedding_length")) // n_heads))


def rotary_fraction(meta: Metadata, d_head: int) -> Optional[float]:
    """``partial_rotary_factor``: the share of the head ``rope.dimension_count`` rotates (None: not stated).

    Example:
        >>> rotary_fraction(Metadata(lambda key, default=None: {"llama.rope.dimension_count": 32}.get(key, default),
        ...                          "llama", set()), d_head=64)
        0.5
    """
    dims = meta.get("rope.dimension_count")
    return None if dims is None else int(dims) / d_head


def is_finite_number(value: Any) -> bool:
    """Whether a metadata value is a real, finite number (not a string, nan or inf).

    Example:
        >>> is_finite_number(1e-5), is_finite_number(float("nan")), is_finite_number("1e-5")
        (True, False, False)
    """
    return isinstance(value, (int, float)) and math.isfinite(value)
