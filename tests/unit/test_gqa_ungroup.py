"""``set_ungroup_grouped_query_attention`` (TransformerLens 3's ``ungroup_grouped_query_attention``).

A grouped-query model's key/value hooks then carry one head per query head, so MHA notebooks' per-head loops
run; unedited, the logits are exactly the grouped ones; an edit to query head h's value reaches head h only
(checked against the hand computation: attention rows sum to one, so adding d to every position's value of
head h adds d to that head's z and d @ W_O[h] to the output). Every kernel, the KV cache, split inputs.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.generation import KVCache
from tests.unit.helpers import make_model, same_weights

TOKENS = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
GQA = ["gqa_rotary_rms_swiglu", "mqa_partial_rotary", "sliding_window_gqa"]
KERNELS = ["eager", "sdpa", "flash"]


@pytest.mark.parametrize("attn_impl", KERNELS)
@pytest.mark.parametrize("variant", GQA)
def test_ungrouped_without_edits_gives_the_grouped_logits_exactly(variant, attn_impl):
    model = make_model(variant, attn_impl=attn_impl)
    grouped = model(TOKENS)
    model.set_ungroup_grouped_query_attention(True)
    assert model.cfg.ungroup_grouped_query_attention
    torch.testing.assert_close(model(TOKENS), grouped, rtol=0, atol=0)
    _, cache = model.run_with_cache(TOKENS, names_filter=lambda name: name.endswith(("hook_k", "hook_v", "hook_rot_k")))
    H, G = model.cfg.n_heads, model.cfg.n_key_value_heads
    for name in ("blocks.0.attn.hook_k", "blocks.0.attn.hook_v", "blocks.1.attn.hook_rot_k"):
        assert cache[name].shape == (2, 9, H, model.cfg.d_head), name
        # each query head holds its group's copy (head h reads key/value head h // (H // G))
        torch.testing.assert_close(cache[name], cache[name][:, :, ::H // G].repeat_interleave(H // G, dim=2),
                                   rtol=0, atol=0)
    model.set_ungroup_grouped_query_attention(False)
    _, cache = model.run_with_cache(TOKENS, names_filter="blocks.0.attn.hook_v")
    assert cache["blocks.0.attn.hook_v"].shape[2] == G  # the default stays grouped


@pytest.mark.parametrize("attn_impl", KERNELS)
def test_an_edit_to_one_heads_value_reaches_that_head_only(attn_impl):
    model = make_model("gqa_rotary_rms_swiglu", attn_impl=attn_impl)
    model.set_ungroup_grouped_query_attention(True)
    head, layer = 3, 1  # head 3 shares its key/value head with head 2 (groups of 2)
    delta = torch.randn(model.cfg.d_head, generator=torch.Generator().manual_seed(0))

    def edit_value(v, hook):
        v = v.clone()
        v[:, :, head] += delta
        return v

    names = [f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.hook_attn_out"]
    _, clean = model.run_with_cache(TOKENS, names_filter=names)
    with model.hooks(fwd_hooks=[(f"blocks.{layer}.attn.hook_v", edit_value)]):
        _, edited = model.run_with_cache(TOKENS, names_filter=names)
    z_clean, z_edited = clean[names[0]], edited[names[0]]
    by_hand = z_clean.clone()
    by_hand[:, :, head] += delta  # each query's weights over the keys sum to one
    torch.testing.assert_close(z_edited, by_hand, atol=1e-5, rtol=1e-5)
    W_O = model.blocks[layer].attn.W_O
    torch.testing.assert_close(edited[names[1]], clean[names[1]] + delta @ W_O[head], atol=1e-5, rtol=1e-5)
    others = [h for h in range(model.cfg.n_heads) if h != head]
    torch.testing.assert_close(z_edited[:, :, others], z_clean[:, :, others], rtol=0, atol=0)


def test_key_norm_per_head_and_split_inputs_under_ungrouping():
    model = make_model("gqa_rotary_rms_swiglu", qk_norm="head", attn_impl="eager")
    grouped = model(TOKENS)
    model.set_ungroup_grouped_query_attention(True)
    torch.testing.assert_close(model(TOKENS), grouped, rtol=0, atol=0)
    model.set_use_split_qkv_input(True)
    _, cache = model.run_with_cache(TOKENS, names_filter=["blocks.0.hook_k_input", "blocks.0.hook_v_input"])
    assert cache["blocks.0.hook_k_input"].shape == (2, 9, model.cfg.n_heads, model.cfg.d_model)
    torch.testing.assert_close(model(TOKENS), grouped, atol=1e-5, rtol=1e-5)  # one matmul per head: rounding


def test_the_kv_cache_holds_ungrouped_heads_and_generation_is_unchanged():
    model = make_model("gqa_rotary_rms_swiglu", attn_impl="sdpa")
    prompt = TOKENS[:1, :5]
    grouped = model.generate(prompt, 6)
    grouped_cache = KVCache(model.cfg.n_layers)
    grouped_steps = [model(prompt, kv_cache=grouped_cache), model(prompt[:, -1:], kv_cache=grouped_cache)]
    model.set_ungroup_grouped_query_attention(True)
    torch.testing.assert_close(model.generate(prompt, 6), grouped, rtol=0, atol=0)
    cache = KVCache(model.cfg.n_layers)
    steps = [model(prompt, kv_cache=cache), model(prompt[:, -1:], kv_cache=cache)]
    assert cache.layers[0].k_BGSK.shape[1] == model.cfg.n_heads
    for ours, reference in zip(steps, grouped_steps):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_load_option_and_refusals(tmp_path):
    make_model("gqa_rotary_rms_swiglu").save(tmp_path)
    model = wb.load_model(tmp_path, ungroup_grouped_query_attention=True)
    assert model.cfg.ungroup_grouped_query_attention
    assert model.run_with_cache(TOKENS, names_filter="blocks.0.attn.hook_k")[1]["blocks.0.attn.hook_k"].shape[2] == 4
    projection = make_model("gqa_rotary_rms_swiglu", qk_norm="projection")
    with pytest.raises(wb.ConfigError, match="qk_norm='projection'"):
        projection.set_ungroup_grouped_query_attention(True)
    assert not projection.cfg.ungroup_grouped_query_attention
    with pytest.raises(wb.ConfigError, match="ungroup_grouped_query_attention must be True or False"):
        model.cfg.ungroup_grouped_query_attention = "yes"
