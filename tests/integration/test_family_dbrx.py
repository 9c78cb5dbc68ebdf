"""DBRX loads at parity with transformers (``family_parity``): its nested attn_config / ffn_config,
fused Wqkv clamped by clip_qkv, bias-free LayerNorms, experts stored as [E * M, D] blocks and the softmax
top-k renormalised by its 1-norm (or not at all).

transformers 5.24's DBRX reads rope_theta from attn_config (as DBRX's own config.json files hold it).
Tiny configs: d_model 48 over 4 heads (2 KV heads), vocab 101, 2 layers, 4 experts of width 20.
"""

from __future__ import annotations

import pytest
from transformers import DbrxConfig

import workbench as wb
from tests.integration.family_parity import Case, family_parity_tests, saved_on_demand
from tests.integration.test_family_llama import _copy

TINY = dict(d_model=48, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=101, bos_token_id=1, eos_token_id=2,
            pad_token_id=2)


def _dbrx(clip_qkv, normalize):
    return lambda: DbrxConfig(**TINY,
                              attn_config={"kv_n_heads": 2, "clip_qkv": clip_qkv, "rope_theta": 10000.0},
                              ffn_config={"ffn_hidden_size": 20, "moe_num_experts": 4, "moe_top_k": 2,
                                          "moe_normalize_expert_weights": normalize})


CASES = {
    "dbrx_clip_qkv_renormalised": Case(_dbrx(0.8, 1.0)),
    # transformers 5.24's DBRX fails without clip_qkv (torch.clamp with neither bound): DBRX's own value, 8
    "dbrx_unnormalised": Case(_dbrx(8.0, None)),
}

globals().update(family_parity_tests(CASES))


saved = saved_on_demand(CASES)


def test_other_expert_weight_norms_are_refused_by_field(saved, tmp_path):
    directory = _copy(saved("dbrx_clip_qkv_renormalised").directory, tmp_path,
                      lambda c: c["ffn_config"].update(moe_normalize_expert_weights=2.0))
    with pytest.raises(wb.ConfigError, match="'ffn_config.moe_normalize_expert_weights'"):
        wb.load_model(directory)
