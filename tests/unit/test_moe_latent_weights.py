"""Mixture-of-experts and latent-attention models' config errors, weight processing and weight views: each
refusal names its field and changes nothing, each fold matches its hand calculation (the unprocessed model's
logits, ``LN(x) @ W`` written out), and the per-head views latent attention lacks are refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.unit.moe_latent_models import (BASE, LATENT, QWEN_SHARED, SIGMOID, SINKS, SOFTMAX, assert_unchanged, build,
                                         snapshot, tokens_BP)
from workbench.errors import ConfigError, InputError


# ---- config errors name their field ------------------------------------------------------------------------
@pytest.mark.parametrize("fields, field", [
    (dict(num_experts=8, experts_per_token=2, router_groups=2, router_topk_groups=3), "moe.router_topk_groups"),
    (dict(num_experts=8, experts_per_token=2, router_scoring="sparsemax"), "moe.router_scoring"),
    (dict(n_key_value_heads=2, kv_lora_rank=16), "n_key_value_heads"),
    (dict(num_experts=8, experts_per_token=5, router_groups=4, router_topk_groups=2), "experts_per_token"),
])
def test_config_errors_name_their_field(fields, field):
    with pytest.raises(ConfigError, match=rf"ModelConfig\.{field}\b"):
        wb.ModelConfig.from_dict({**BASE, **fields})


# ---- weight processing and the weight API: refusals change nothing -----------------------------------------
STEPS_OFF = dict(fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False)


@pytest.mark.parametrize("steps", [dict(STEPS_OFF, fold_ln=True), {}])
def test_fold_ln_refuses_latent_attention(steps):
    model = build(**LATENT)
    before = snapshot(model)
    with pytest.raises(ConfigError, match=r"fold_ln.*kv_lora_rank=16"):
        model.process_weights_(**steps)
    assert_unchanged(model, before)


def test_latent_attention_takes_the_steps_it_can():
    model = build(**LATENT)
    tokens = tokens_BP()
    with torch.no_grad():
        expected = model(tokens).log_softmax(-1)
        model.process_weights_(**dict(STEPS_OFF, center_unembed=True, fold_value_biases=True))
        got = model(tokens).log_softmax(-1)
    assert model.cfg.weight_processing == ("center_unembed", "fold_value_biases")
    assert (got - expected).abs().max() < 1e-4


def test_fold_value_biases_refuses_sinks_with_a_value_bias():
    model = build(**SINKS)
    before = snapshot(model)
    with pytest.raises(ConfigError, match=r"fold_value_biases.*attn_sinks.*layer\(s\) \[0, 1\]"):
        model.process_weights_(**dict(STEPS_OFF, fold_value_biases=True))
    assert_unchanged(model, before)
    # A LayerNorm model without attention biases: fold_ln would create b_V from ln1.b, so the pair is refused ...
    ln_model = build(**dict(SINKS, attn_bias=False, normalization="LN"))
    before = snapshot(ln_model)
    with pytest.raises(ConfigError, match=r"fold_value_biases.*attn_sinks"):
        ln_model.process_weights_(**dict(STEPS_OFF, fold_ln=True, fold_value_biases=True))
    assert_unchanged(ln_model, before)
    # ... while fold_ln alone is right (the sink logits read no weights) and keeps the logits.
    tokens = tokens_BP()
    with torch.no_grad():
        expected = ln_model(tokens)
        ln_model.process_weights_(**dict(STEPS_OFF, fold_ln=True))
        assert (ln_model(tokens) - expected).abs().max() < 1e-4
    # With every value bias zero there is nothing to fold, and the step goes through.
    with torch.no_grad():
        for block in model.blocks:
            block.attn._b_V_lin.zero_()
        expected = model(tokens)
        model.process_weights_(**dict(STEPS_OFF, fold_value_biases=True))
        assert (model(tokens) - expected).abs().max() < 1e-5


def test_fold_ln_folds_into_router_experts_and_the_gated_shared_expert_of_mixed_layers():
    """A dense first layer, then a sigmoid router with correction, groups, router and expert biases and a
    gated shared expert: folding ln2's gain must reach every reader (the logits stay, ln2.w becomes one)."""
    model = build(**dict(SIGMOID, router_bias=True, expert_bias=True, shared_expert_gate=True,
                  layer_overrides=({"num_experts": 0, "experts_per_token": 0}, {})))
    assert model.cfg.moe_layers == [1]
    tokens = tokens_BP()
    with torch.no_grad():
        expected = model(tokens)
        model.process_weights_(**dict(STEPS_OFF, fold_ln=True))
        got = model(tokens)
    assert (got - expected).abs().max() < 1e-4
    assert all(bool((block.ln2.w == 1).all()) for block in model.blocks)


def test_center_writing_weights_centres_expert_and_shared_expert_outputs_over_d_model():
    model = build(**dict(QWEN_SHARED, normalization="LN", expert_bias=True, mlp_bias=True))
    tokens = tokens_BP()
    with torch.no_grad():
        expected = model(tokens)
        model.process_weights_(**dict(STEPS_OFF, center_writing_weights=True))
        got = model(tokens)
    assert (got - expected).abs().max() < 1e-4
    for block in model.blocks:
        moe = block.mlp
        assert moe.b_out.mean(-1).abs().max() < 1e-6  # each expert's [d_model] bias, not across experts
        assert moe.W_out.mean(-1).abs().max() < 1e-6
        assert moe.shared.W_out.mean(-1).abs().max() < 1e-6 and moe.shared.b_out.mean().abs() < 1e-6


def test_fold_ln_refuses_a_layernorm_bias_before_a_mixture_with_router_and_expert_biases():
    model = build(**dict(SOFTMAX, normalization="LN", router_bias=True, expert_bias=True))
    before = snapshot(model)
    with pytest.raises(ConfigError, match=r"fold_ln: the LayerNorm bias ln2\.b \(nonzero in layer\(s\) \[0, 1\]\).*"
                                          r"router_bias=True, expert_bias=True.*not implemented"):
        model.process_weights_(**dict(STEPS_OFF, fold_ln=True))
    assert_unchanged(model, before)


@pytest.mark.parametrize("name", ["W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "QK", "OV"])
def test_latent_attention_has_no_per_head_qkv_weights(name):
    model = build(**LATENT)
    before = snapshot(model)
    with pytest.raises(InputError, match=rf"model\.{name}: .*kv_lora_rank=16.*no per-head linear W_K/W_V.*hook_k"):
        getattr(model, name)
    assert_unchanged(model, before)


def test_latent_attention_w_o_is_per_head_over_d_head_v():
    model = build(**LATENT)
    W_O = model.W_O
    assert W_O.shape == (2, 4, 10, 32)
    z_BPHJ = torch.randn(1, 3, 4, 10)
    for layer, block in enumerate(model.blocks):  # z W_O summed over heads is the output projection
        by_hand = torch.einsum("bphj,hjd->bpd", z_BPHJ, W_O[layer])
        torch.testing.assert_close(by_hand, F.linear(z_BPHJ.flatten(-2), block.attn._W_O_lin), atol=1e-5, rtol=1e-5)
    assert model.b_O.shape == (2, 32)


def test_stacks_over_dense_and_expert_layers_and_expert_biases_are_refused_by_name():
    model = build(**dict(SOFTMAX, expert_bias=True, layer_overrides=({"num_experts": 0, "experts_per_token": 0}, {})))
    with pytest.raises(InputError, match=r"model\.W_in: .*layer\(s\) \[0\]: \[32, 128\]; layer\(s\) \[1\]: "
                                         r"\[6, 32, 128\].*moe_layers=\[1\]"):
        model.W_in
    with pytest.raises(InputError, match=r"accumulated_bias: layer 1's experts have output biases "
                                         r"\(expert_bias=True\)"):
        model.accumulated_bias(2)
    assert model.accumulated_bias(2, include_mlp_biases=False).shape == (32,)
