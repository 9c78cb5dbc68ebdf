"""More mixture-of-experts families in HF format, as a table of ``llama.Variant``s read by
``llama``'s own mapping: each is a Llama-like decoder whose router and experts are a row of
``experts.MOE_KINDS`` (read off transformers 5.24's ``modeling_*.py``):

    OLMoE        OLMo 2's QK norm over the whole projection (pre-norm blocks), clip_qkv; softmax top-k,
                 renormalised with norm_topk_prob
    MiniMax-M2   QK norm over the projection, partial rotary; sigmoid scores plus a correction bias choose,
                 the chosen scores renormalised weigh (block_sparse_moe.experts.{e}.w1/w3/w2)
    GLM-4.5      (glm4_moe) GLM's biased q/k/v, partial rotary on halves, optional per-head QK norm;
                 DeepSeek-V3's routing and shared experts, the first first_k_dense_replace layers dense
    dots.llm1    Qwen3's attention (per-head QK norm, windows per layer_types); DeepSeek-V3's routing
    ERNIE 4.5    ERNIE's attention (adjacent-pair RoPE, use_bias); softmax plus correction bias, the sum
    MoE          clamped at moe_norm_min; shared experts; experts every moe_layer_interval-th layer
    HunYuan MoE  HunYuan's attention (QK norm after RoPE, NTK alpha); renormalised softmax, one shared MLP
    Phi-3.5-MoE  (phimoe) LayerNorms with biases, biased attention and lm_head, windows; sparsemixer routing
    GraniteMoE   Granite's four multipliers; top-k then softmax; experts fused in input_linear [E, 2M, D]
                 (gate rows first) / output_linear [E, D, M]; GraniteMoeShared adds a shared MLP (shared_mlp)

Refused by name (``REFUSED``): JetMoE, whose attention is itself a mixture of experts (a router choosing
query and output projections per token), a component the workbench does not have.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

from workbench.loading.family import Family
from workbench.loading.hf import llama, modern
from workbench.loading.hf.llama import Variant
from workbench.loading.hf.modern import granite_multipliers, hunyuan_rope


def _minimax_rotary_dim(data: dict[str, Any]) -> dict[str, Any]:
    """Released MiniMax-M2 config.json files give partial RoPE as ``rotary_dim``; transformers reads it as
    ``partial_rotary_factor = rotary_dim / head_dim`` unless a factor is given."""
    params = data.get("rope_parameters") or {}
    if data.get("rotary_dim") is not None and "partial_rotary_factor" not in {**data, **params}:
        data["partial_rotary_factor"] = int(data["rotary_dim"]) / int(data["head_dim"])
    return data


_GRANITE_MOE = dict(qkv_bias_field="attention_bias", moe="granitemoe", extra_fields=granite_multipliers)
_GROUPED_DEFAULTS = {"n_group": 1, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
                     "routed_scaling_factor": 1.0}

VARIANTS = {
    "OlmoeForCausalLM": Variant(qkv_bias_field="attention_bias", norm_eps=1e-5, qk_norm="projection",
                                clip_qkv_field="clip_qkv", moe="olmoe",
                                extra_fields=lambda hf: {"clip_qkv_after_qk_norm": True},
                                defaults={"num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False}),
    "MiniMaxM2ForCausalLM": Variant(qk_norm="projection", partial_rotary=True, moe="minimax_m2", prepare=_minimax_rotary_dim,
                                    defaults={"num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 256,
                                              "num_experts_per_tok": 8}),
    "Glm4MoeForCausalLM": Variant(qkv_bias_field="attention_bias", o_proj_bias=False, partial_rotary=True,
                                  moe="grouped_sigmoid",
                                  extra_fields=lambda hf: {"qk_norm": "head" if hf.get("use_qk_norm", False) else None},
                                  defaults={**_GROUPED_DEFAULTS, "num_key_value_heads": 8, "partial_rotary_factor": 0.5,
                                            "n_routed_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True}),
    "Dots1ForCausalLM": Variant(qkv_bias_field="attention_bias", qk_norm="head", sliding="layer_types",
                                moe="grouped_sigmoid",
                                prepare=modern._default_layer_types(
                                    lambda data, i: data.get("sliding_window") is not None
                                    and i >= int(data.get("max_window_layers", 62))),
                                defaults={**_GROUPED_DEFAULTS, "n_routed_experts": 128, "num_experts_per_tok": 6,
                                          "norm_topk_prob": False, "sliding_window": 4096, "max_window_layers": 62}),
    "Ernie4_5_MoeForCausalLM": Variant(qkv_bias_field="use_bias", mlp_bias_field="use_bias", unembed_bias_field="use_bias",
                                       rotary_adjacent_pairs=True, norm_eps=1e-5, moe="ernie4_5_moe",
                                       defaults={"num_key_value_heads": 2, "head_dim": 128, "tie_word_embeddings": True,
                                                 "moe_num_experts": 64, "moe_k": 6, "moe_num_shared_experts": 2}),
    "HunYuanMoEV1ForCausalLM": Variant(qkv_bias_field="attention_bias", norm_eps=1e-5, qk_norm="head",
                                       qk_norm_names=("query_layernorm", "key_layernorm"), prepare=hunyuan_rope,
                                       moe="hunyuan_v1_moe", extra_fields=lambda hf: {"qk_norm_after_rotary": True},
                                       defaults={"num_experts": 1, "moe_topk": 1}),
    "PhimoeForCausalLM": Variant(qkv_bias_field="attention_bias", sliding="every_layer", normalization="LN",
                                 norm_bias=True, norm_eps=1e-5, unembed_bias_field="lm_head_bias", moe="phimoe",
                                 defaults={"num_key_value_heads": 8, "num_local_experts": 16, "num_experts_per_tok": 2,
                                           "router_jitter_noise": 0.01}),
    "GraniteMoeForCausalLM": Variant(**_GRANITE_MOE),
    "GraniteMoeSharedForCausalLM": Variant(**_GRANITE_MOE),
}

# Architectures transformers builds that this workbench refuses, and why (loader.py names the reason).
REFUSED = {
    "JetMoeForCausalLM": "JetMoE's attention is itself a mixture of experts (a router picks each token's query and "
                         "output projections among num_local_experts, over shared keys and values), a component the "
                         "workbench does not have",
}

# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={
        "OlmoeForCausalLM": ("olmoe", "OLMoE (QK norm over the projection, softmax top-k)"),
        "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMax-M2 (sigmoid routing with a correction bias, partial rotary)"),
        "Glm4MoeForCausalLM": ("glm4_moe", "GLM-4.5, GLM-4.6 (DeepSeek-V3 routing, shared experts, partial rotary)"),
        "Dots1ForCausalLM": ("dots1", "rednote dots.llm1 (DeepSeek-V3 routing, QK norm)"),
        "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", "ERNIE 4.5 MoE (softmax plus correction bias, shared experts)"),
        "HunYuanMoEV1ForCausalLM": ("hunyuan_v1_moe", "Hunyuan-A13B (QK norm after RoPE, shared MLP)"),
        "PhimoeForCausalLM": ("phimoe", "Phi-3.5-MoE (sparsemixer routing, LayerNorms)"),
        "GraniteMoeForCausalLM": ("granitemoe", "IBM Granite 3.x MoE (multipliers, fused experts)"),
        "GraniteMoeSharedForCausalLM": ("granitemoeshared", "IBM Granite MoE with a shared expert"),
    },
    model_config=partial(llama.model_config, variants=VARIANTS),
    convert_tensors=partial(modern.convert_tensors, variants=VARIANTS),
    ignored_tensors=re.compile(r".*rotary_emb\.inv_freq$"),
),)
