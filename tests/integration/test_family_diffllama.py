"""DiffLlama loads at parity with transformers (``family_parity``): differential attention (two
softmax maps per head pair, a learned lambda per layer, the paired heads' values RMS-normed), with its own
hook points for each map.

Tiny configs: d_model 48 over 4 query heads (2 KV heads; 8 heads over 4 in the second), vocab 101, 3 layers
(lambda_init differs per layer).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DiffLlamaConfig

import workbench as wb
from tests.integration.family_parity import TOLERANCE, Case, family_parity_tests, max_diff, saved_on_demand
from tests.integration.test_family_llama import _copy

TINY = dict(vocab_size=101, hidden_size=48, num_hidden_layers=3, intermediate_size=80, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=2, lambda_std_dev=0.3)

CASES = {
    "diffllama_gqa": Case(lambda: DiffLlamaConfig(**TINY, num_attention_heads=4, num_key_value_heads=2)),
    "diffllama_bias_8_over_4": Case(lambda: DiffLlamaConfig(**TINY, num_attention_heads=8, num_key_value_heads=4,
                                                            head_dim=6, attention_bias=True)),
}

globals().update(family_parity_tests(CASES))


saved = saved_on_demand(CASES)


def test_each_map_has_its_own_editable_hook_point(saved):
    """hook_pattern_1 / hook_pattern_2 are query heads i and i + H/2 of hook_pattern; zeroing the second map of
    every head is differential attention with lambda = 0, which changes the logits."""
    case = saved("diffllama_gqa")
    model = wb.load_model(case.directory, attn_impl="sdpa")
    with torch.no_grad():
        _, cache = model.run_with_cache(case.tokens, names_filter=lambda n: "pattern" in n)
        pattern = cache["blocks.1.attn.hook_pattern"]
        assert torch.equal(cache["blocks.1.attn.hook_pattern_1"], pattern[:, :2])
        assert torch.equal(cache["blocks.1.attn.hook_pattern_2"], pattern[:, 2:])
        hooks = [(f"blocks.{layer}.attn.hook_pattern_2", lambda p, hook: torch.zeros_like(p)) for layer in range(3)]
        edited = model.run_with_hooks(case.tokens, fwd_hooks=hooks)
    assert max_diff(edited, case.logits) > 100 * TOLERANCE


def test_odd_key_value_heads_are_refused_by_field(saved, tmp_path):
    directory = _copy(saved("diffllama_gqa").directory, tmp_path, lambda c: c.update(num_key_value_heads=1))
    with pytest.raises(wb.ConfigError, match="'num_key_value_heads'"):
        wb.load_model(directory)


def test_value_biases_are_not_folded_through_the_pair_norm(saved):
    """fold_value_biases is refused (the RMS norm over each head pair sits between b_V and W_O); the other
    steps keep the logits (fold_ln into the projections, centring W_O, centring W_U)."""
    case = saved("diffllama_bias_8_over_4")
    model = wb.load_model(case.directory)
    with pytest.raises(wb.ConfigError, match="fold_value_biases: .*differential"):
        model.process_weights_()
    with torch.no_grad():
        processed = model.process_weights_(fold_value_biases=False)(case.tokens)
    centred = case.logits - case.logits.mean(-1, keepdim=True)
    assert max_diff(processed, centred) < TOLERANCE
