import pytest
import torch

from tests.unit.helpers import make_model, same_weights
from workbench.components.attention import LayerKVCache
from workbench.generation import KVCache, generate_tokens, sample_next


@pytest.mark.parametrize("variant", ["gqa_rotary_rms_swiglu", "mha_learned_ln", "sliding_window_gqa", "alibi_gelu_new",
                                     "moe_gqa"])
@pytest.mark.parametrize("impl", ["eager", "sdpa", "flash"])
def test_kv_cached_generation_equals_recomputing_prefix(variant, impl):
    model = same_weights(make_model(variant), attn_impl=impl)
    prompt = torch.randint(0, 61, (2, 5))
    cached, cached_logits = generate_tokens(model, prompt, 12, use_kv_cache=True, stop_at_eos=False)
    full, full_logits = generate_tokens(model, prompt, 12, use_kv_cache=False, stop_at_eos=False)
    assert torch.equal(cached, full)
    torch.testing.assert_close(cached_logits, full_logits, atol=1e-5, rtol=0)
    # and greedy really is argmax of a plain forward on the final sequence
    with torch.no_grad():
        logits = model(full[:, :-1])
    assert torch.equal(logits[:, 4:].argmax(-1), full[:, 5:])


def test_sampling_is_reproducible_with_seed_and_respects_top_k():
    model = make_model("gqa_rotary_rms_swiglu")
    prompt = torch.randint(0, 61, (1, 4))
    a, _ = generate_tokens(model, prompt, 10, temperature=1.0, top_k=3, seed=7, stop_at_eos=False)
    b, _ = generate_tokens(model, prompt, 10, temperature=1.0, top_k=3, seed=7, stop_at_eos=False)
    assert torch.equal(a, b)
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    draws = {sample_next(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(s)).item() for s in range(50)}
    assert draws == {1, 2}
    nucleus = {sample_next(logits, 1.0, top_p=0.5, generator=torch.Generator().manual_seed(s)).item() for s in range(50)}
    assert nucleus == {1}  # p(token 1) = 0.67 > 0.5 already


def test_kv_cache_tracks_length():
    model = make_model("gqa_rotary_rms_swiglu")
    cache = KVCache(model.cfg.n_layers)
    model(torch.randint(0, 61, (1, 6)), kv_cache=cache)
    model(torch.randint(0, 61, (1, 1)), kv_cache=cache)
    assert cache.length == 7
    assert cache.layers[0].k_BGSK.shape == (1, 2, 7, 8)


@pytest.mark.parametrize("variant", ["gqa_rotary_rms_swiglu", "mha_learned_ln"])
def test_a_cache_that_grows_many_times_gives_the_full_forward(variant, monkeypatch):
    # Two spare positions: the buffers are regrown every few steps, each time keeping what they held.
    monkeypatch.setattr(LayerKVCache, "SPARE_POSITIONS", 2)
    model = make_model(variant)
    tokens = torch.randint(0, 61, (2, 30))
    cache = KVCache(model.cfg.n_layers)
    with torch.no_grad():
        steps = [model(tokens[:, :3], kv_cache=cache)] + [model(tokens[:, p:p + 1], kv_cache=cache)
                                                          for p in range(3, 30)]
        full = model(tokens)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.length == 30 and cache.layers[0].k_BGSK.shape[2] == 30


def test_gradients_flow_through_every_call_on_a_cache():
    # Under autograd each call keeps the keys and values it attended to: a later call must not write into them.
    model = make_model("gqa_rotary_rms_swiglu")
    tokens = torch.randint(0, 61, (1, 6))
    cache = KVCache(model.cfg.n_layers)
    first = model(tokens[:, :5], kv_cache=cache)
    second = model(tokens[:, 5:], kv_cache=cache)
    (first.sum() + second.sum()).backward()
    full = model(tokens)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=1e-5, rtol=0)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full.sum().backward()
    for cached_grad, p in zip(grads, model.parameters()):
        torch.testing.assert_close(cached_grad, p.grad, atol=1e-4, rtol=1e-4)


def test_step_logits_are_the_forward_logits_and_can_be_left_out():
    model = make_model("gqa_rotary_rms_swiglu")
    prompt = torch.randint(0, 61, (2, 5))
    tokens, step_logits = generate_tokens(model, prompt, 6, stop_at_eos=False)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    torch.testing.assert_close(step_logits, logits[:, 4:], atol=1e-5, rtol=0)
    seen = []
    with model.hooks(fwd_hooks=[("ln_final.hook_normalized", lambda x, hook: seen.append(x.shape[1]))]):
        same, none = generate_tokens(model, prompt, 6, stop_at_eos=False, keep_logits=False)
    assert torch.equal(same, tokens) and none is None
    assert seen == [5, 1, 1, 1, 1, 1]  # the final norm's hooks see the whole prompt, then each new token
