"""eager, sdpa and flash agree; patterns stay readable and editable under every kernel."""

import pytest
import torch

from tests.unit.helpers import make_model, same_weights
from workbench.components.attention_kernels import MaskSpec, eager_attention, tiled_flash_attention

KERNEL_VARIANTS = ["mha_learned_ln", "gqa_rotary_rms_swiglu", "mqa_partial_rotary", "alibi_gelu_new",
                   "sliding_window_gqa", "moe_gqa"]


@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
@pytest.mark.parametrize("impl", ["sdpa", "flash"])
def test_logits_and_every_hook_agree_with_eager(variant, impl):
    eager = make_model(variant, attn_impl="eager")
    fast = same_weights(eager, attn_impl=impl)
    tokens = torch.randint(0, eager.cfg.d_vocab, (3, 23))
    with torch.no_grad():
        torch.testing.assert_close(fast(tokens), eager(tokens), atol=1e-5, rtol=0)
        # run_with_cache of every hook attaches pattern hooks (forcing eager); cache everything
        # *except* scores/pattern so the fast kernel really runs, then compare every value.
        not_pattern = lambda name: not name.endswith(("hook_pattern", "hook_attn_scores"))
        _, fast_cache = fast.run_with_cache(tokens, names_filter=not_pattern)
        _, eager_cache = eager.run_with_cache(tokens, names_filter=not_pattern)
    assert fast_cache.keys() == eager_cache.keys()
    for name in eager_cache.keys():
        torch.testing.assert_close(fast_cache[name], eager_cache[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("impl", ["sdpa", "flash"])
def test_pattern_read_under_fast_kernel_equals_eager(impl):
    eager = make_model("sliding_window_gqa", attn_impl="eager")
    fast = same_weights(eager, attn_impl=impl)
    tokens = torch.randint(0, eager.cfg.d_vocab, (2, 17))
    only_patterns = lambda name: name.endswith(("hook_pattern", "hook_attn_scores"))
    with torch.no_grad():
        fast_logits, fast_cache = fast.run_with_cache(tokens, names_filter=only_patterns)
        eager_logits, eager_cache = eager.run_with_cache(tokens, names_filter=only_patterns)
    for name in eager_cache.keys():
        torch.testing.assert_close(fast_cache[name], eager_cache[name], atol=1e-6, rtol=0)
    torch.testing.assert_close(fast_logits, eager_logits, atol=1e-5, rtol=0)
    pattern = fast_cache["blocks.0.attn.hook_pattern"]
    torch.testing.assert_close(pattern.sum(-1), torch.ones_like(pattern[..., 0]))
    i, j = torch.meshgrid(torch.arange(17), torch.arange(17), indexing="ij")
    hidden = (j > i) | (i - j >= 5)  # causal + sliding window of 5
    assert pattern[..., hidden].abs().max() == 0


@pytest.mark.parametrize("impl", ["sdpa", "flash"])
def test_editing_pattern_under_fast_kernel_matches_eager(impl):
    eager = make_model("gqa_rotary_rms_swiglu", attn_impl="eager")
    fast = same_weights(eager, attn_impl=impl)
    tokens = torch.randint(0, eager.cfg.d_vocab, (2, 13))

    def attend_to_first_token(pattern, hook):
        pattern = torch.zeros_like(pattern)
        pattern[..., 0] = 1.0
        return pattern

    hooks = [("blocks.1.attn.hook_pattern", attend_to_first_token)]
    with torch.no_grad():
        edited_fast = fast.run_with_hooks(tokens, fwd_hooks=hooks)
        edited_eager = eager.run_with_hooks(tokens, fwd_hooks=hooks)
        clean = fast(tokens)
    torch.testing.assert_close(edited_fast, edited_eager, atol=1e-5, rtol=0)
    assert (edited_fast - clean).abs().max() > 1e-3


def test_only_the_hooked_layer_falls_back_to_eager(monkeypatch):
    model = make_model("gqa_rotary_rms_swiglu", attn_impl="flash")
    calls = []
    import workbench.components.attention as attention_module

    original = attention_module.eager_attention
    monkeypatch.setattr(attention_module, "eager_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model.run_with_cache(torch.randint(0, 61, (1, 9)), names_filter="blocks.1.attn.hook_pattern")
    assert len(calls) == 1  # layer 1 only; layer 0 kept the flash kernel
    model(torch.randint(0, 61, (1, 9)))
    assert len(calls) == 1  # hooks were removed: no eager afterwards


@pytest.mark.parametrize("window, alibi", [(None, False), (7, False), (None, True), (9, True)])
@pytest.mark.parametrize("heads, kv", [(4, 4), (6, 2), (4, 1)])
def test_tiled_flash_kernel_matches_eager_kernel_with_small_tiles(window, alibi, heads, kv):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, heads, 37, 8), torch.randn(2, kv, 37, 8), torch.randn(2, kv, 37, 8)
    slopes = torch.linspace(0.1, 0.5, heads) if alibi else None
    mask = MaskSpec(scale=0.3, sliding_window=window, alibi_slopes_H=slopes)
    expected = eager_attention(q, k, v, mask)
    got = tiled_flash_attention(q, k, v, mask, block_q=8, block_k=5)  # tiles that don't divide 37
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_tiled_flash_handles_cached_queries_offset():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    mask = MaskSpec(scale=0.35, q_offset=17, sliding_window=6)
    torch.testing.assert_close(tiled_flash_attention(q, k, v, mask, block_q=2, block_k=4),
                               eager_attention(q, k, v, mask), atol=1e-5, rtol=0)
