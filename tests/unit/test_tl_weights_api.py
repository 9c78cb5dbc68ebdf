"""Weights under TransformerLens's names mean what they mean in TransformerLens.

Each check recomputes an activation by hand from the TransformerLens-layout weights (``x @ W_Q[h]``,
``z @ W_O[h]``, ``x @ W_in`` ...) and compares it with what the forward pass put on the hook point,
so a wrong view (a transposed or mis-grouped head) fails.
"""

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.unit.helpers import make_model

TOKENS = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 6, 0, 1, 2]])


@pytest.mark.parametrize("variant", ["alibi_gelu_new", "gqa_rotary_rms_swiglu", "mqa_partial_rotary"])
def test_qkv_and_o_views_reproduce_the_hooked_activations(variant):
    model = make_model(variant)
    _, cache = model.run_with_cache(TOKENS)
    attn, cfg = model.blocks[1].attn, model.cfg
    x = cache["blocks.1.ln1.hook_normalized"]  # [B, P, D]
    zero = torch.zeros(cfg.n_heads, cfg.d_head)
    b_Q = attn.b_Q if attn.b_Q is not None else zero
    b_K = attn.b_K if attn.b_K is not None else zero
    for h in range(cfg.n_heads):
        g = h // (cfg.n_heads // cfg.n_key_value_heads)  # the key/value head of h's group
        torch.testing.assert_close(cache["blocks.1.attn.hook_q"][:, :, h], x @ attn.W_Q[h] + b_Q[h], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache["blocks.1.attn.hook_k"][:, :, g], x @ attn.W_K[h] + b_K[h], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache["blocks.1.attn.hook_k"][:, :, g], x @ attn._W_K[g] + b_K[h], atol=1e-5, rtol=0)
    z = cache["blocks.1.attn.hook_z"]  # [B, P, H, K]
    by_hand = sum(z[:, :, h] @ attn.W_O[h] for h in range(cfg.n_heads))
    by_hand = by_hand + (attn.b_O if attn.b_O is not None else 0)
    torch.testing.assert_close(cache["blocks.1.hook_attn_out"], by_hand, atol=1e-5, rtol=0)
    assert attn.W_Q.shape == (cfg.n_heads, cfg.d_model, cfg.d_head) and attn.W_O.shape == (cfg.n_heads, cfg.d_head, cfg.d_model)
    assert attn._W_K.shape == (cfg.n_key_value_heads, cfg.d_model, cfg.d_head)


@pytest.mark.parametrize("variant", ["mha_learned_ln", "gqa_rotary_rms_swiglu"])
def test_mlp_and_unembedding_views_reproduce_the_forward(variant):
    model = make_model(variant)
    logits, cache = model.run_with_cache(TOKENS)
    mlp = model.blocks[0].mlp
    x = cache["blocks.0.ln2.hook_normalized"]
    b_in = mlp.b_in if mlp.b_in is not None else 0
    gate_or_pre = x @ (mlp.W_gate if model.cfg.gated_mlp else mlp.W_in)
    torch.testing.assert_close(cache["blocks.0.mlp.hook_pre"], gate_or_pre + b_in, atol=1e-5, rtol=0)
    out = cache["blocks.0.mlp.hook_post"] @ mlp.W_out + (mlp.b_out if mlp.b_out is not None else 0)
    torch.testing.assert_close(cache["blocks.0.hook_mlp_out"], out, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, cache["ln_final.hook_normalized"] @ model.W_U, atol=1e-5, rtol=0)
    assert mlp.W_in.shape == (32, 128) and mlp.W_out.shape == (128, 32) and model.W_U.shape == (32, 61)


def test_writing_through_a_view_edits_the_model():
    model = make_model("gqa_rotary_rms_swiglu")
    expected = model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.attn.hook_z", lambda z, hook: z.index_fill(2, torch.tensor([3]), 0))])
    with torch.no_grad():
        model.blocks[1].attn.W_O[3] = 0  # head 3 writes nothing
    torch.testing.assert_close(model(TOKENS), expected, atol=1e-5, rtol=0)


def test_model_level_stacks_and_factored_circuits():
    model = make_model("alibi_gelu_new")
    L, H, D, K = 2, 4, 32, 8
    assert model.W_Q.shape == (L, H, D, K) and model.W_O.shape == (L, H, K, D) and model.b_O.shape == (L, D)
    assert torch.equal(model.W_Q[1], model.blocks[1].attn.W_Q) and torch.equal(model.b_V[0], model.blocks[0].attn.b_V)
    assert torch.equal(model.W_in[0], model.blocks[0].mlp.W_in) and model.W_E is model.embed.W_E
    torch.testing.assert_close(model.QK[1, 2].AB, model.blocks[1].attn.W_Q[2] @ model.blocks[1].attn.W_K[2].T)
    torch.testing.assert_close(model.OV[0, 1].AB, model.blocks[0].attn.W_V[1] @ model.blocks[0].attn.W_O[1])
    llama_like = make_model("gqa_rotary_rms_swiglu")
    assert torch.equal(llama_like.b_Q, torch.zeros(L, H, K))  # no such bias: zeros, as a TransformerLens model has
    with pytest.raises(wb.InputError, match="no absolute position embedding"):
        llama_like.W_pos


def test_accumulated_bias_by_hand():
    model = make_model("alibi_gelu_new")  # attention and MLP biases
    b_O = [block.attn.b_O for block in model.blocks]
    b_out = [block.mlp.b_out for block in model.blocks]
    torch.testing.assert_close(model.accumulated_bias(0), torch.zeros(32))
    torch.testing.assert_close(model.accumulated_bias(1), b_O[0] + b_out[0])
    torch.testing.assert_close(model.accumulated_bias(1, mlp_input=True), b_O[0] + b_out[0] + b_O[1])
    torch.testing.assert_close(model.accumulated_bias(2, include_mlp_biases=False), b_O[0] + b_O[1])
    with pytest.raises(wb.InputError, match="layer"):
        model.accumulated_bias(3)


def test_set_use_attn_result_keeps_the_output_and_negative_stop_at_layer():
    model = make_model("mha_learned_ln")
    logits, cache = model.run_with_cache(TOKENS)
    model.set_use_attn_result(True)
    assert model.cfg.use_attn_result and all(block.attn.options is model.options for block in model.blocks)
    torch.testing.assert_close(model(TOKENS), logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(model(TOKENS, stop_at_layer=-1), cache["blocks.1.hook_resid_pre"])
    with pytest.raises(wb.InputError, match="stop_at_layer=3"):
        model(TOKENS, stop_at_layer=3)
    torch.testing.assert_close(F.log_softmax(model(TOKENS), -1), F.log_softmax(logits, -1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["mha_learned_ln", "gqa_rotary_rms_swiglu"])
def test_split_qkv_input_gives_each_head_its_own_input(variant):
    model = make_model(variant)
    logits = model(TOKENS)
    model.set_use_split_qkv_input(True)
    assert model.cfg.use_split_qkv_input and all(block.options is model.options for block in model.blocks)
    out, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(out, logits, atol=1e-5, rtol=0)  # the same model, per-head inputs
    H, G = model.cfg.n_heads, model.cfg.n_key_value_heads
    assert cache["blocks.1.hook_q_input"].shape == (2, 6, H, 32) and cache["blocks.1.hook_k_input"].shape == (2, 6, G, 32)

    nudge = torch.linspace(-2.0, 3.0, 32)  # not constant: a LayerNorm would centre a constant away

    def nudge_head_2(q_input, hook):  # patch query head 2's input only
        q_input = q_input.clone()
        q_input[:, :, 2] += nudge
        return q_input

    seen = {}
    keep = lambda name: (lambda act, hook: seen.__setitem__(name, act.clone()))  # noqa: E731
    model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.hook_q_input", nudge_head_2),
                                            ("blocks.1.attn.hook_q", keep("q")), ("blocks.1.attn.hook_k", keep("k"))])
    others = [h for h in range(H) if h != 2]
    torch.testing.assert_close(seen["q"][:, :, others], cache["blocks.1.attn.hook_q"][:, :, others], atol=1e-6, rtol=0)
    torch.testing.assert_close(seen["k"], cache["blocks.1.attn.hook_k"], atol=1e-6, rtol=0)
    # by hand: head 2's query is ln1 of its own (nudged) copy, read by W_Q[2]
    attn, ln1 = model.blocks[1].attn, model.blocks[1].ln1
    x = cache["blocks.1.hook_resid_pre"] + nudge
    b_Q = attn.b_Q[2] if attn.b_Q is not None else 0
    torch.testing.assert_close(seen["q"][:, :, 2], ln1(x) @ attn.W_Q[2] + b_Q, atol=1e-5, rtol=0)
    assert (seen["q"][:, :, 2] - cache["blocks.1.attn.hook_q"][:, :, 2]).abs().max() > 1e-3


def test_split_qkv_input_needs_a_pre_norm_model():
    model = make_model("sinusoidal_postnorm")
    with pytest.raises(wb.ConfigError, match="use_split_qkv_input"):
        model.set_use_split_qkv_input(True)
    assert not model.cfg.use_split_qkv_input
    assert "blocks.0.hook_q_input" not in model.run_with_cache(torch.tensor([[1, 2, 3]]))[1]
