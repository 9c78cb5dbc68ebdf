"""One model shared by many threads (``workbench.call_lock``): no call ever sees another's hooks, caches or prompt.

Hundreds of interleaved calls of three kinds (an ablation through ``run_with_hooks``, a ``run_with_cache``, a
plain forward), each compared exactly with the same call run alone."""

import random
from concurrent.futures import ThreadPoolExecutor

import torch

from tests.unit.helpers import make_model
from workbench.hook_point import caching

N_PROMPTS, CALLS, THREADS = 4, 300, 4


def test_threads_sharing_a_model_never_see_each_others_hooks_caches_or_prompts():
    model = make_model("gqa_rotary_rms_swiglu", attn_impl="sdpa")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.d_vocab, (2, 9), generator=generator) for _ in range(N_PROMPTS)]

    def ablated(i: int) -> torch.Tensor:  # head i zeroed in layer 0
        def zero_head(z, hook):
            z[:, :, i] = 0
            return z
        return model.run_with_hooks(prompts[i], fwd_hooks=[("blocks.0.attn.hook_z", zero_head)])

    def cached(i: int) -> torch.Tensor:
        _, cache = model.run_with_cache(prompts[i], names_filter=lambda name: name.endswith("hook_resid_post"))
        return torch.stack([cache[f"blocks.{l}.hook_resid_post"] for l in range(model.cfg.n_layers)])

    def plain(i: int) -> torch.Tensor:
        return model(prompts[i])

    kinds = {"ablated": ablated, "cached": cached, "plain": plain}

    def run(call):
        with torch.no_grad():
            return call, kinds[call[0]](call[1])

    # Each call alone, one after another, in a worker thread as the shared calls run: a thread's intra-op
    # thread count (which another test may have changed for the main thread) decides the GEMMs' rounding.
    every_call = [(kind, i) for kind in kinds for i in range(N_PROMPTS)]
    with ThreadPoolExecutor(1) as pool:
        alone = dict(pool.map(run, every_call))
    calls = every_call * (CALLS // len(every_call) + 1)
    random.Random(0).shuffle(calls)
    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(run, calls[:CALLS]))
    wrong = [call for call, result in results if not torch.equal(result, alone[call])]
    assert wrong == [], f"{len(wrong)} of {CALLS} calls saw another thread's hooks, cache or prompt: {wrong[:5]}"
    assert model.attached_hooks() == {}


def test_a_hooks_block_holds_the_model_until_it_ends():
    model = make_model("mha_learned_ln")
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), ThreadPoolExecutor(1) as pool:
        clean = pool.submit(model, tokens).result()  # in a worker thread, as the call compared with it
        with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x * 0)]):
            other = pool.submit(model, tokens)  # another thread's plain forward: waits for the block to end
            hooked = model(tokens)
        assert torch.equal(other.result(), clean) and not torch.allclose(hooked, clean)


def test_attached_hooks_counts_cache_sinks_too():
    model = make_model("mha_learned_ln")
    with caching(model.hook_dict, lambda name: name == "hook_embed", {}):
        assert model.attached_hooks() == {"hook_embed": 1}
    assert model.attached_hooks() == {}
