"""Circuits on a model other threads use: the edge switches (``use_split_qkv_input``, grouped-query attention
ungrouped) change hook shapes model-wide, so EAP and ACDC flip them only while holding the model's call lock.

The expected values are each call run alone, one after another, in a worker thread (a thread's intra-op thread
count decides the GEMMs' rounding, as in tests/unit/test_threads.py)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from experiments.circuits import PairedPrompts, acdc, edge_attribution_patching
from experiments.metrics import LogitDiff
from tests.unit.helpers import make_model

TOKENS = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(5))
CORRUPT = TOKENS.clone()
CORRUPT[:, 2] = (TOKENS[:, 2] + 13) % 61
NAMES = ("blocks.0.attn.hook_k", "blocks.1.attn.hook_v", "blocks.1.hook_resid_post")
CACHES, EAP_RUNS = 24, 3


@pytest.fixture(scope="module")
def model():
    return make_model("gqa_rotary_rms_swiglu", attn_impl="sdpa")  # 4 query heads over 2 key/value heads


def options(model) -> tuple[bool, bool]:
    return model.cfg.use_split_qkv_input, model.cfg.ungroup_grouped_query_attention


def test_eap_and_run_with_cache_in_two_threads_each_equal_their_solo_runs(model):
    data = PairedPrompts.from_prompts(model, TOKENS, CORRUPT, metric=LogitDiff(torch.tensor([3, 5]),
                                                                               torch.tensor([7, 9])))
    before = options(model)

    def cached(i: int) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            _, cache = model.run_with_cache(TOKENS if i % 2 == 0 else CORRUPT, names_filter=list(NAMES))
        return {name: cache[name] for name in NAMES}

    def scores(_: int) -> torch.Tensor:
        return edge_attribution_patching(model, data, batch_size=1).scores

    with ThreadPoolExecutor(1) as pool:
        solo_caches = [pool.submit(cached, i).result() for i in range(2)]
        solo_scores = pool.submit(scores, 0).result()
    assert solo_caches[0]["blocks.0.attn.hook_k"].shape[2] == 2  # grouped: two key heads when no switch is on
    with ThreadPoolExecutor(2) as pool:
        eap_runs = [pool.submit(scores, i) for i in range(EAP_RUNS)]
        cache_runs = [pool.submit(cached, i) for i in range(CACHES)]
        caches = [run.result() for run in cache_runs]
        found = [run.result() for run in eap_runs]
    wrong = [i for i, cache in enumerate(caches)
             if any(cache[n].shape != solo_caches[i % 2][n].shape or not torch.equal(cache[n], solo_caches[i % 2][n])
                    for n in NAMES)]
    assert wrong == [], f"{len(wrong)} of {CACHES} caches ran under another thread's edge switches: {wrong[:5]}"
    for got in found:
        torch.testing.assert_close(got, solo_scores, rtol=0, atol=0)
    assert options(model) == before == (False, False)
    assert model.attached_hooks() == {}


def test_an_error_inside_eap_or_acdc_restores_the_callers_options(model):
    def broken(logits, tokens):
        raise RuntimeError("metric failed")

    data = PairedPrompts.from_prompts(model, TOKENS, CORRUPT, metric=broken)
    model.set_use_split_qkv_input(True)  # the caller's own switch: it must come back as the caller left it
    try:
        with pytest.raises(RuntimeError, match="metric failed"):
            edge_attribution_patching(model, data)
        assert options(model) == (True, False)
        with pytest.raises(RuntimeError, match="metric failed"):
            acdc(model, data, threshold=0.1)
        assert options(model) == (True, False)
        assert model.attached_hooks() == {}
    finally:
        model.set_use_split_qkv_input(False)
    with ThreadPoolExecutor(1) as pool:  # and the lock was released: another thread's call runs
        assert pool.submit(lambda: model(TOKENS).shape).result(timeout=60) == (2, 7, 61)
