"""Modern Llama-like families load at parity with transformers (``family_parity``): Granite (its four
multipliers), Helium (RoPE on adjacent pairs), Ministral (windows per layer), Ministral 3 (yarn and
position-scaled queries), Seed-OSS (q/k/v and o biases switched apart), OLMo 3 (windows), EXAONE 4
(norms after the sublayers, QK norm, NoPE on full layers), HunYuan dense (QK norm after RoPE, NTK
alpha), ERNIE 4.5, GLM and GLM-4 (fused gate_up, partial rotary on adjacent pairs; GLM-4's sandwich
norms) and InternLM3, whose remote-code config.json (``qkv_bias`` / ``bias``) is written over a
transformers Llama or Qwen2 checkpoint with the same computation. Values these architectures cannot
honour are refused by field before any weight is read.

Tiny configs as ``test_family_llama``'s: d_model 48 over 6 heads (2 KV heads), vocab 101, 2-3 layers,
windows of 5 tokens and original contexts of 8 positions, shorter than the 24-token prompt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import (ApertusConfig, ArceeConfig, Cohere2Config, CohereConfig, Ernie4_5Config, NemotronConfig, PersimmonConfig, Exaone4Config, Glm4Config, GlmConfig, GraniteConfig, HeliumConfig,
                          HunYuanDenseV1Config, LlamaConfig, Ministral3Config, MinistralConfig, Olmo3Config,
                          Qwen2Config, SeedOssConfig, VaultGemmaConfig)

import workbench as wb
import workbench.loading.hf as hf_loading
from tests.integration.family_parity import Case, build_and_save, family_parity_tests, max_diff, saved_on_demand

TINY = dict(vocab_size=101, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=80, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=2)
THREE = {**TINY, "num_hidden_layers": 3}
SLIDING_FULL_SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]


def as_internlm3(qkv_bias: bool, bias: bool):
    """The config.json InternLM3's remote code reads, over a transformers checkpoint that computes the
    same: its biases are ``qkv_bias`` (q, k, v) and ``bias`` (o_proj and the MLP)."""

    def edit(config: dict) -> dict:
        for key in ("attention_bias", "mlp_bias", "layer_types", "use_sliding_window", "max_window_layers"):
            config.pop(key, None)
        return {**config, "architectures": ["InternLM3ForCausalLM"], "model_type": "internlm3",
                "qkv_bias": qkv_bias, "bias": bias}

    return edit


MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.5}

APERTUS_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0}

CASES = {
    "granite_multipliers_bias": Case(lambda: GraniteConfig(
        **TINY, embedding_multiplier=3.0, attention_multiplier=0.3, residual_multiplier=0.6, logits_scaling=2.5,
        attention_bias=True, mlp_bias=True)),
    "granite_tied": Case(lambda: GraniteConfig(**TINY, embedding_multiplier=2.0, attention_multiplier=0.2,
                                               residual_multiplier=0.4, logits_scaling=0.5, tie_word_embeddings=True)),
    "helium_adjacent_rope_bias": Case(lambda: HeliumConfig(**TINY, head_dim=8, attention_bias=True, mlp_bias=True)),
    "ministral_sliding_layers": Case(lambda: MinistralConfig(**THREE, head_dim=8, sliding_window=5,
                                                             layer_types=SLIDING_FULL_SLIDING)),
    "ministral3_query_scale_yarn": Case(lambda: Ministral3Config(**TINY, head_dim=8,
                                                                 rope_parameters=MINISTRAL3_ROPE)),
    "seed_oss_qkv_bias": Case(lambda: SeedOssConfig(**TINY, head_dim=8, attention_bias=True, mlp_bias=True)),
    "seed_oss_out_bias_only": Case(lambda: SeedOssConfig(**TINY, head_dim=8, attention_bias=False,
                                                         attention_out_bias=True)),
    "olmo3_sliding_layers": Case(lambda: Olmo3Config(**THREE, sliding_window=5, layer_types=SLIDING_FULL_SLIDING)),
    "exaone4_sliding_nope_full": Case(lambda: Exaone4Config(**THREE, sliding_window=5, sliding_window_pattern=2)),
    "hunyuan_dense_ntk_alpha_bias": Case(lambda: HunYuanDenseV1Config(
        **TINY, head_dim=8, attention_bias=True,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.0, "alpha": 4.0})),
    "ernie4_5_bias_tied": Case(lambda: Ernie4_5Config(**TINY, head_dim=8, use_bias=True, tie_word_embeddings=True)),
    "glm_partial_rotary": Case(lambda: GlmConfig(**TINY, head_dim=8)),
    "glm4_sandwich": Case(lambda: Glm4Config(**TINY, head_dim=8)),
    "cohere_qk_norm_bias": Case(lambda: CohereConfig(**TINY, use_qk_norm=True, attention_bias=True, logit_scale=0.3)),
    "cohere_untied": Case(lambda: CohereConfig(**TINY, tie_word_embeddings=False, logit_scale=2.0)),
    "cohere2_sliding_rope_layers": Case(lambda: Cohere2Config(**THREE, sliding_window=5, logit_scale=0.5,
                                                              layer_types=SLIDING_FULL_SLIDING)),
    "arcee_relu2_bias": Case(lambda: ArceeConfig(**TINY, mlp_bias=True, attention_bias=True)),
    "nemotron_layernorm1p_partial_rotary": Case(lambda: NemotronConfig(**TINY, attention_bias=True, mlp_bias=True)),
    "apertus_xielu_llama3_rope": Case(lambda: ApertusConfig(**TINY, rope_parameters=APERTUS_ROPE)),
    "vaultgemma_caps_windows": Case(lambda: VaultGemmaConfig(
        **THREE, head_dim=8, sliding_window=5, query_pre_attn_scalar=32, attn_logit_softcapping=5.0,
        final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh")),
    "persimmon_qk_layernorm": Case(lambda: PersimmonConfig(**{k: v for k, v in TINY.items() if k != "num_key_value_heads"})),
    "internlm3_all_biases": Case(lambda: LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
                                 edit_config=as_internlm3(qkv_bias=True, bias=True)),
    "internlm3_qkv_bias": Case(lambda: Qwen2Config(**TINY), edit_config=as_internlm3(qkv_bias=True, bias=False)),
}

globals().update(family_parity_tests(CASES))
