"""Older and structurally different dense families load at parity with transformers (``family_parity``),
padded batches equal transformers' with the mask, and configurations we cannot honour are refused naming
the field before any weight is read.

Falcon: the old layout (multi-query, parallel attention with one shared norm; multi-head sequential)
and the new one (grouped-query, two norms or one); GPT-BigCode (multi-query and multi-head);
StarCoder2 (grouped-query, a sliding window); MPT (ALiBi over 8 and 6 heads, clip_qkv,
softmax_scale); CodeGen (partial and full rotary); XGLM (fairseq's sinusoidal positions); OpenAI GPT
(post-norm). Tiny configs: d_model 48 over 6 heads (d_head 8), vocab 101, 2 layers.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (CodeGenConfig, FalconConfig, GPTBigCodeConfig, MptConfig, OpenAIGPTConfig, Starcoder2Config,
                          XGLMConfig)

import workbench as wb
import workbench.loading.hf.loader as hf_loading
from tests.integration.family_parity import Case, build_and_save, family_parity_tests
from tests.integration.hf_tiny import N_CTX, VOCAB
from tests.integration.test_padding_parity import padded_batch

_SPECIAL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=2)
_FALCON = dict(**_SPECIAL, hidden_size=48, num_attention_heads=6, num_hidden_layers=2, ffn_hidden_size=80,
               max_position_embeddings=N_CTX)


_BIGCODE = dict(**_SPECIAL, n_embd=48, n_head=6, n_layer=2, n_inner=80, n_positions=N_CTX)
_STARCODER2 = dict(**_SPECIAL, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
                   intermediate_size=80, max_position_embeddings=N_CTX)
_MPT = dict(**_SPECIAL, d_model=48, n_heads=6, n_layers=2, max_seq_len=N_CTX)
_CODEGEN = dict(**_SPECIAL, n_embd=48, n_head=6, n_layer=2, n_positions=N_CTX)
# XGLM pads with 1 as its checkpoints do (transformers zeroes the position row pad_token_id).
_XGLM = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=2, pad_token_id=1, d_model=48, attention_heads=6,
             num_layers=2, ffn_dim=80, max_position_embeddings=N_CTX)
_GPT1 = dict(vocab_size=VOCAB, n_embd=48, n_head=6, n_layer=2, n_positions=N_CTX)


def falcon(**changes) -> FalconConfig:
    return FalconConfig(**{**_FALCON, **changes})


CASES = {
    # Falcon-7B's shape: one key/value head, attention and MLP reading one norm, no biases, tied.
    "falcon_old_mqa_parallel": Case(lambda: falcon()),
    # Falcon-RW's layout (with RoPE: its ALiBi is refused): multi-head, sequential block, biases, untied.
    "falcon_old_mha_sequential_bias": Case(lambda: falcon(multi_query=False, parallel_attn=False, bias=True,
                                                          tie_word_embeddings=False)),
    # Falcon-40B's shape: grouped-query, two norms (ln_attn, ln_mlp), RoPE base 500.
    "falcon_new_gqa_two_norms": Case(lambda: falcon(new_decoder_architecture=True, num_kv_heads=2,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    # Falcon2-11B's: the new layout with one norm (num_ln_in_parallel_attn 1); biases, exact GELU named.
    "falcon_new_one_norm_bias": Case(lambda: falcon(new_decoder_architecture=True, num_kv_heads=3, bias=True,
                                                    num_ln_in_parallel_attn=1, activation="gelu")),
    # SantaCoder / StarCoder: one key/value head, tanh GELU, tied.
    "bigcode_mqa": Case(lambda: GPTBigCodeConfig(**_BIGCODE)),
    # Multi-head ([H, 3, K] rows), unscaled scores, exact GELU, untied.
    "bigcode_mha_unscaled_untied": Case(lambda: GPTBigCodeConfig(**_BIGCODE, multi_query=False,
                                                                 scale_attn_weights=False,
                                                                 activation_function="gelu",
                                                                 tie_word_embeddings=False)),
    # StarCoder2: grouped-query, biases, tied; and a window of 5 without biases, untied.
    "starcoder2_gqa_bias": Case(lambda: Starcoder2Config(**_STARCODER2)),
    "starcoder2_window_no_bias": Case(lambda: Starcoder2Config(**_STARCODER2, sliding_window=5, use_bias=False,
                                                               tie_word_embeddings=False)),
    # MPT: ALiBi over 8 heads (a power of two), tied.
    "mpt_8_heads": Case(lambda: MptConfig(**{**_MPT, "d_model": 64, "n_heads": 8})),
    # 6 heads (ALiBi's interleaved slopes), q/k/v clamped to 0.5, softmax_scale 0.2, untied.
    "mpt_6_heads_clip_scale_untied": Case(lambda: MptConfig(**_MPT, tie_word_embeddings=False,
                                                            attn_config={"clip_qkv": 0.5, "softmax_scale": 0.2})),
    # CodeGen: GPT-J's block, the fused qkv_proj over 4 shards; partial and full rotary, tied once.
    "codegen_partial_rotary": Case(lambda: CodeGenConfig(**_CODEGEN, rotary_dim=4)),
    "codegen_full_rotary_tied": Case(lambda: CodeGenConfig(**_CODEGEN, rotary_dim=8, n_inner=80,
                                                           tie_word_embeddings=True, activation_function="gelu")),
    # XGLM: fairseq's sinusoidal table, embeddings scaled by sqrt(d_model), tied; unscaled and untied.
    "xglm_scaled_tied": Case(lambda: XGLMConfig(**_XGLM)),
    "xglm_unscaled_untied_relu": Case(lambda: XGLMConfig(**_XGLM, scale_embedding=False, tie_word_embeddings=False,
                                                         activation_function="relu")),
    # OpenAI GPT: post-norm, no final norm, afn "gelu" (tanh), tied; and SiLU, untied.
    "openai_gpt_post_norm": Case(lambda: OpenAIGPTConfig(**_GPT1)),
    "openai_gpt_silu_untied": Case(lambda: OpenAIGPTConfig(**_GPT1, afn="silu", tie_word_embeddings=False)),
}

globals().update(family_parity_tests(CASES))

# ---- padded batches: each real position's logits equal transformers' under the same mask ---------------
PADDED = ("falcon_new_gqa_two_norms", "bigcode_mqa", "starcoder2_window_no_bias", "mpt_6_heads_clip_scale_untied",
          "codegen_partial_rotary", "xglm_scaled_tied", "openai_gpt_post_norm")


@pytest.fixture(scope="module", params=PADDED)
def padded_pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"padded_{request.param}")
    return request.param, build_and_save(CASES[request.param].config(), directory), wb.load_model(directory)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_equal_transformers(padded_pair, side):
    name, hf_model, ours = padded_pair
    tokens, mask = padded_batch(side)
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # as generate computes them
    with torch.no_grad():
        expected = hf_model(tokens, attention_mask=mask, position_ids=positions).logits
        for kernel in ("eager", "sdpa", "flash"):
            logits = ours.set_attn_impl(kernel)(tokens, attention_mask=mask)
            difference = (logits[mask.bool()] - expected[mask.bool()]).abs().max().item()
            assert difference < 1e-4, f"{name} {side} {kernel}: {difference:.2e}"


# ---- values we cannot honour: a ConfigError naming the field, raised before any weight is read ----------
REFUSALS = {
    # transformers' own eager and SDPA runs disagree (the bias added twice under eager)
    "falcon_alibi": ("falcon_old_mqa_parallel", {"alibi": True}, "alibi"),
    "falcon_new_sequential": ("falcon_new_gqa_two_norms", {"parallel_attn": False}, "parallel_attn"),
    "falcon_partial_rotary": ("falcon_new_gqa_two_norms",
                              {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    "falcon_activation": ("falcon_old_mqa_parallel", {"activation": "mish"}, "activation"),
    "falcon_old_grouped": ("falcon_old_mha_sequential_bias", {"num_kv_heads": 2}, "num_kv_heads"),
    "bigcode_cross_attention": ("bigcode_mqa", {"add_cross_attention": True}, "add_cross_attention"),
    "mpt_no_alibi": ("mpt_8_heads", {"attn_config": {"alibi": False}}, "alibi"),
    "mpt_alibi_bias_max": ("mpt_8_heads", {"attn_config": {"alibi_bias_max": 16}}, "alibi_bias_max"),
    "mpt_qk_ln": ("mpt_8_heads", {"attn_config": {"qk_ln": True}}, "qk_ln"),
    "mpt_expansion_ratio": ("mpt_8_heads", {"expansion_ratio": 2}, "expansion_ratio"),
    "mpt_biases": ("mpt_8_heads", {"no_bias": False}, "no_bias"),
    "mpt_logit_scale": ("mpt_8_heads", {"logit_scale": 0.5}, "logit_scale"),
    "codegen_rotary_dim": ("codegen_partial_rotary", {"rotary_dim": 12}, "rotary_dim"),
    "codegen_shards": ("codegen_partial_rotary", {"n_embd": 42, "n_head": 6}, "n_embd"),
    "xglm_pad_row_read": ("xglm_scaled_tied", {"pad_token_id": 2}, "pad_token_id"),
    "xglm_cross_attention": ("xglm_scaled_tied", {"add_cross_attention": True}, "add_cross_attention"),
    "openai_gpt_activation": ("openai_gpt_post_norm", {"afn": "gelu_fast"}, "afn"),
    "starcoder2_partial_rotary": ("starcoder2_gqa_bias", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
}


@pytest.fixture(scope="module")
def refusal_sources(tmp_path_factory):
    """One saved directory per case that a refusal edits (built once, copied per test)."""
    out = {}
    for name in sorted({case for case, _, _ in REFUSALS.values()}):
        out[name] = tmp_path_factory.mktemp(f"refuse_{name}")
        build_and_save(CASES[name].config(), out[name])
    return out


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_unhonourable_config_value_is_refused_by_field_before_reading_weights(refusal, refusal_sources, tmp_path,
                                                                              monkeypatch):
    case, changes, field = REFUSALS[refusal]
    for path in refusal_sources[case].iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were opened before the config was checked")

    monkeypatch.setattr(hf_loading, "SafetensorsCheckpoint", no_weights)
    with pytest.raises(wb.ConfigError, match=rf"field '[\w.]*{field}' = .* cannot be honoured"):
        wb.load_model(tmp_path)
