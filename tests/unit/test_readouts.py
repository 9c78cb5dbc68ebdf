"""The model's per-layer reads (``workbench.readouts``): an expert's hidden activations and the router's
distribution are the forward pass's own math, the weight reads are the layers' weights, and a wrong
request is an ``InputError`` that names what is wrong.

Expected values are written out here: the MLP output rebuilt token by token from the read hidden
activations, the router's rules as plain softmax / sigmoid, gpt-oss's clamped SwiGLU by its formula.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.errors import InputError
from workbench.options import split_saved_config

BASE = dict(n_layers=2, d_model=16, n_heads=4, d_vocab=40, n_ctx=16, positional="rotary", normalization="RMS",
            gated_mlp=True, act_fn="silu", d_mlp=12, attn_impl="eager")
GPT_OSS = dict(num_experts=4, experts_per_token=2, router_scoring="topk_softmax", router_bias=True, expert_bias=True,
               swiglu_limit=0.5, swiglu_alpha=1.702, attn_bias=True)
DEEPSEEK = dict(num_experts=4, experts_per_token=2, router_scoring="sigmoid", d_shared_expert=20,
                layer_overrides=({"num_experts": 0, "experts_per_token": 0, "d_mlp": 24}, {}))


def build(seed: int = 0, **fields) -> wb.Decoder:
    torch.manual_seed(seed)
    cfg, options = split_saved_config({**BASE, **fields})  # flat names and attn_impl, as a saved config.json
    model = wb.Decoder(cfg, **options)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith(".w") else 0.0, 0.2 if name.endswith(".w") else 0.5)
    return model.eval()


def _mlp_inputs(model, tokens, layer):
    names = {f"blocks.{layer}.ln2.hook_normalized", f"blocks.{layer}.mlp.hook_expert_indices",
             f"blocks.{layer}.mlp.hook_expert_weights", f"blocks.{layer}.hook_mlp_out",
             f"blocks.{layer}.mlp.hook_router_logits"}
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    return {name.split(f"blocks.{layer}.")[1]: cache[name][0] for name in names}


def test_expert_hidden_rebuilds_the_forward_passes_mlp_output():
    model = build(**GPT_OSS)
    tokens = torch.randint(0, 40, (1, 9))
    layer = 1
    got = _mlp_inputs(model, tokens, layer)
    x_PD = got["ln2.hook_normalized"]
    W_out, b_out = model.W_out[layer], model.blocks[layer].mlp.b_out
    rebuilt_PD = torch.zeros_like(x_PD)
    for p in range(x_PD.shape[0]):
        for e, weight in zip(got["mlp.hook_expert_indices"][p].tolist(), got["mlp.hook_expert_weights"][p]):
            hidden_M = model.expert_hidden(layer, e, x_PD[p:p + 1])[0]
            rebuilt_PD[p] += weight * (hidden_M @ W_out[e] + b_out[e])
    torch.testing.assert_close(rebuilt_PD, got["hook_mlp_out"], atol=1e-5, rtol=1e-5)


def test_expert_hidden_is_the_clamped_swiglu():
    model = build(**GPT_OSS)
    mlp, expert, limit, alpha = model.blocks[0].mlp, 3, 0.5, 1.702
    x_ND = torch.randn(6, 16)
    gate = (x_ND @ mlp.W_gate[expert] + mlp.b_gate[expert]).clamp(max=limit)
    up = (x_ND @ mlp.W_in[expert] + mlp.b_in[expert]).clamp(-limit, limit)
    expected = (up + 1) * gate * torch.sigmoid(alpha * gate)
    assert (gate == limit).any() and (up.abs() == limit).any()  # the clamp is exercised
    torch.testing.assert_close(model.expert_hidden(0, expert, x_ND), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fields, rule", [(dict(num_experts=4, experts_per_token=2), "softmax"),
                                          (GPT_OSS, "softmax"), (DEEPSEEK, "sigmoid")])
def test_router_probabilities_as_the_router_scores(fields, rule):
    model = build(**fields)
    layer = model.cfg.moe_layers[-1]
    logits_PE = _mlp_inputs(model, torch.randint(0, 40, (1, 7)), layer)["mlp.hook_router_logits"]
    if rule == "softmax":
        expected = logits_PE.float().softmax(-1)
    else:
        expected = logits_PE.float().sigmoid() / logits_PE.float().sigmoid().sum(-1, keepdim=True)
    probs_PE = model.router_probabilities(layer, logits_PE)
    torch.testing.assert_close(probs_PE, expected)
    torch.testing.assert_close(probs_PE.sum(-1), torch.ones(7))


def test_weight_reads_are_the_layers_weights():
    model = build(**DEEPSEEK, attn_bias=True)
    assert torch.equal(model.layer_W_out(0), model.blocks[0].mlp.W_out)  # the dense first layer: [24, 16]
    assert model.layer_W_out(0).shape == (24, 16)
    assert torch.equal(model.layer_W_out(1, expert=2), model.blocks[1].mlp.W_out[2])
    assert torch.equal(model.layer_W_out(1, shared=True), model.blocks[1].mlp.shared.W_out)
    for layer in range(2):
        assert torch.equal(model.layer_W_O(layer), model.W_O[layer])
        assert torch.equal(model.layer_b_O(layer), model.b_O[layer])


def test_a_layer_without_attention_bias_reads_none_where_the_stack_reads_zeros():
    model = build()
    assert model.layer_b_O(1) is None
    assert torch.equal(model.b_O[1], torch.zeros(16))


def test_latent_attention_reads_its_output_weights():
    model = build(n_key_value_heads=4, d_head=12, rotary_dim=4, d_head_v=10, kv_lora_rank=16, q_lora_rank=20)
    assert model.layer_W_O(1).shape == (4, 10, 16)
    with pytest.raises(InputError, match="latent attention"):
        model.W_Q


@pytest.mark.parametrize("read, message", [
    (lambda m: m.layer_W_O(2), r"layer must be in 0\.\.1, got 2"),
    (lambda m: m.layer_b_O(-1), r"layer must be in 0\.\.1, got -1"),
    (lambda m: m.layer_W_out(0, expert=1), "layer 0 is a dense MLP: it has no experts"),
    (lambda m: m.layer_W_out(1), "layer 1 is a mixture of experts: choose an expert"),
    (lambda m: m.layer_W_out(1, expert=4), r"layer 1 has experts 0\.\.3, got 4"),
    (lambda m: m.layer_W_out(5, expert=0), r"layer must be in 0\.\.1, got 5"),
    (lambda m: m.expert_hidden(0, 1, torch.zeros(2, 16)), "layer 0 is a dense MLP: it has no experts"),
    (lambda m: m.expert_hidden(1, 9, torch.zeros(2, 16)), r"layer 1 has experts 0\.\.3, got 9"),
    (lambda m: m.router_probabilities(0, torch.zeros(1, 2, 4)), "layer 0 is a dense MLP: it has no experts"),
    (lambda m: m.router_probabilities(2, torch.zeros(1, 2, 4)), r"layer must be in 0\.\.1, got 2"),
])
def test_wrong_requests_name_what_is_wrong(read, message):
    with pytest.raises(InputError, match=message):
        read(build(**DEEPSEEK))


def test_mlp_reads_of_an_attention_only_model_and_a_missing_shared_expert():
    with pytest.raises(InputError, match="attention-only"):
        build(attn_only=True).layer_W_out(0)
    with pytest.raises(InputError, match="attention-only"):
        build(attn_only=True).router_probabilities(0, torch.zeros(1, 1, 4))
    with pytest.raises(InputError, match="no shared expert"):
        build(num_experts=4, experts_per_token=2).layer_W_out(1, shared=True)
