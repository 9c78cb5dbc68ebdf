"""Llama 4's text decoder loads at parity with transformers (``family_parity``): MoE layers (the
top k of the router logits, each expert's input times its sigmoid, a shared expert) and dense layers,
chunked attention on the RoPE layers, NoPE layers with attention temperature tuning, the QK L2 norm,
RoPE on adjacent pairs with llama3 scaling.

Tiny config: d_model 48 over 4 heads (2 KV heads), vocab 101, 4 layers (MoE on layers 1 and 3, NoPE on
layer 3), chunks of 8 positions and a temperature floor of 4, both shorter than the 24-token prompt.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Llama4TextConfig

import workbench as wb
from tests.integration.family_parity import TOLERANCE, Case, family_parity_tests, max_diff, saved_on_demand
from tests.integration.test_family_llama import _copy
from tests.integration.test_padding_parity import padded_batch

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
TINY = dict(vocab_size=101, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
            num_hidden_layers=4, intermediate_size=20, intermediate_size_mlp=80, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=2, num_local_experts=4, num_experts_per_tok=2,
            interleave_moe_layer_step=2, no_rope_layer_interval=4, attention_chunk_size=8, floor_scale=4,
            attn_scale=0.5, rope_parameters=LLAMA3_ROPE)

CASES = {
    "llama4_moe_dense_chunked_nope": Case(lambda: Llama4TextConfig(**TINY)),
}

globals().update(family_parity_tests(CASES))


saved = saved_on_demand(CASES)

FEATURES = {  # each edit switches one of Llama 4's values off: the logits must move
    "chunked_attention": lambda c: c.update(attention_chunk_size=None, layer_types=None),
    "temperature_tuning": lambda c: c.update(attn_temperature_tuning=False),
    "qk_l2_norm": lambda c: c.update(use_qk_norm=False),
    "nope_layer": lambda c: c.update(no_rope_layers=[1, 1, 1, 1], layer_types=None),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_llama4_value_changes_the_logits(saved, feature, tmp_path):
    case = saved("llama4_moe_dense_chunked_nope")
    with torch.no_grad():
        changed = wb.load_model(_copy(case.directory, tmp_path, FEATURES[feature]))(case.tokens)
    assert max_diff(changed, case.logits) > 100 * TOLERANCE


def test_config_values_map_as_written(saved):
    cfg = wb.load_model(saved("llama4_moe_dense_chunked_nope").directory).cfg
    assert cfg.moe_layers == [1, 3] and cfg.layer_values("d_mlp") == [80, 20, 80, 20]
    assert cfg.layer_values("positional") == ["rotary", "rotary", "rotary", "none"]
    assert cfg.layer_values("attention_chunk_size") == [8, 8, 8, None]
    assert cfg.layer_values("qk_norm") == ["head", "head", "head", None]
    assert cfg.layer_values("query_scale_beta") == [None, None, None, 0.5]
    assert (cfg.moe.router_scoring, cfg.moe.router_weights_input, cfg.moe.d_shared_expert) == ("topk_sigmoid", True, 20)


def test_router_choices_match_transformers(saved):
    """Llama4Router returns (scores over all experts, logits): the chosen experts are its finite scores."""
    case = saved("llama4_moe_dense_chunked_nope")
    model = wb.load_model(case.directory)
    found = {}
    handles = [case.hf_model.model.layers[layer].feed_forward.router.register_forward_hook(
        lambda _m, _i, out, layer=layer: found.__setitem__(layer, out)) for layer in model.cfg.moe_layers]
    names = [f"blocks.{layer}.mlp.hook_{hook}" for layer in model.cfg.moe_layers
             for hook in ("router_logits", "expert_indices", "expert_weights")]
    try:
        with torch.no_grad():
            case.hf_model(case.tokens)
            _, cache = model.run_with_cache(case.tokens, names_filter=lambda n: n in names)
    finally:
        for handle in handles:
            handle.remove()
    for layer, (scores_NE, logits_NE) in found.items():
        assert max_diff(cache[f"blocks.{layer}.mlp.hook_router_logits"].reshape(logits_NE.shape), logits_NE) < TOLERANCE
        ours = torch.zeros_like(scores_NE)  # HF's sigmoid(-inf) = 0 for the experts not chosen
        ours.scatter_(1, cache[f"blocks.{layer}.mlp.hook_expert_indices"].reshape(scores_NE.shape[0], -1),
                      cache[f"blocks.{layer}.mlp.hook_expert_weights"].reshape(scores_NE.shape[0], -1))
        assert max_diff(ours, scores_NE) < TOLERANCE


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_equal_their_prompts_alone(saved, side):
    """Each padded row equals transformers' run of its prompt alone at every real position (chunks and the
    temperature count from the row's first real token). Transformers' own left-padded batch does not: its
    temperature reads the absolute index."""
    case = saved("llama4_moe_dense_chunked_nope")
    tokens, mask = padded_batch(side)
    ours = wb.load_model(case.directory)
    with torch.no_grad():
        for kernel in ("eager", "sdpa", "flash"):
            logits = ours.set_attn_impl(kernel)(tokens, attention_mask=mask)
            for row in range(tokens.shape[0]):
                real = mask[row].bool()
                alone = case.hf_model(tokens[row, real][None]).logits[0]
                assert max_diff(logits[row, real], alone) < TOLERANCE, (side, kernel, row)
