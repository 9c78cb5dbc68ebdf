"""What a dashboard link can make a page compute: the Attribution page builds no graph over its stated budget
(``plan_attribution``'s adjacency and forward copies), says so and offers a setting that fits, before allocating;
the corpus passes (and cache files) the feature card can start stay within a bounded set; NaN or infinity in a link
is dropped like any out-of-range value."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import app.results.attribution as attribution_results
import app.results.features as feature_results
import workbench as wb
from app.results.attribution import LoadedTranscoders, attribution_plan
from app.state import LoadedModel
from app.url_state import decode
from experiments.attribution import plan_attribution
from tests.unit.test_app_pages import APP

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "attribution"
MODEL, PLT = str(FIXTURES / "tiny_llama"), str(FIXTURES / "plt")
PROMPT = "the cat sat on the mat and"
MiB = 2**20


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "[0.2, NaN]"])
@pytest.mark.parametrize("kind", ["slider", "number_input"])
def test_nan_and_infinity_in_a_link_are_refused_like_an_out_of_range_value(kind, raw):
    with pytest.raises(ValueError):
        decode(kind, raw, (), {"min_value": 0.0, "max_value": 1.0, "value": 0.5})
    with pytest.raises(ValueError):   # no bounds to fall outside of: still not a value
        decode(kind, raw, (), {"value": 0.5})
    assert decode(kind, "[0.2, 0.7]" if raw.startswith("[") else "0.2", (), {"min_value": 0.0, "max_value": 1.0,
                                                                            "value": 0.5}) in (0.2, (0.2, 0.7))


def test_a_nan_link_value_falls_back_to_the_default_with_a_warning():
    at = AppTest.from_file(str(APP / "pages" / "13_Attribution.py"), default_timeout=120)
    at.session_state["model_source"] = MODEL
    at.session_state["prompt"] = PROMPT
    at.query_params["attribution_logit_prob"] = "NaN"
    at.query_params["attribution_tc_source"] = "A path on this machine"
    at.query_params["attribution_tc_path"] = PLT
    at.run()
    at.button(key="attribution_open_tc").click().run()   # the settings are drawn once the transcoders are open
    assert not at.exception, [e.value for e in at.exception]
    assert any("attribution_logit_prob" in w.value and "does not fit" in w.value for w in at.warning)
    assert at.number_input(key="attribution_logit_prob").value == 0.95


@pytest.fixture(scope="module")
def traced():
    model = wb.load_model(MODEL, progress=False)
    return LoadedModel(model, "tiny-llama-budget|eager"), LoadedTranscoders(wb.load_transcoders(PLT), "plt-budget")


def _planned(loaded, loaded_tc, n_tokens, max_feature_nodes):
    """adjacency + forward bytes from plan_attribution itself, for the settings the page passes."""
    table = plan_attribution(loaded.model, loaded_tc.transcoders, n_tokens, max_n_logits=10,
                             max_feature_nodes=max_feature_nodes or None, batch_size=256)
    parts = dict(zip(table.part, table.bytes))
    return parts["adjacency"] + parts["forward"]


def test_the_plan_is_plan_attributions_and_the_offered_setting_is_the_largest_that_fits(traced):
    loaded, loaded_tc = traced
    ids = tuple(5 + i % 10 for i in range(loaded.model.cfg.n_ctx - 1))   # BOS + these: the whole context
    budget = 170 * MiB
    plan = attribution_plan(loaded, loaded_tc, ids, (10, 0.95, 0, 256), budget=budget)
    assert plan.bytes == _planned(loaded, loaded_tc, len(ids) + 1, 0) > budget and not plan.within
    fits = plan.feature_nodes
    assert fits and _planned(loaded, loaded_tc, len(ids) + 1, fits) <= budget
    assert _planned(loaded, loaded_tc, len(ids) + 1, fits + 1) > budget
    assert attribution_plan(loaded, loaded_tc, ids, (10, 0.95, fits, 256), budget=budget).within
    assert attribution_plan(loaded, loaded_tc, ids, (10, 0.95, 0, 256), budget=10 * MiB).feature_nodes == 0
    assert attribution_plan(loaded, loaded_tc, ids[:6], (10, 0.95, 0, 256)).within   # the default budget


def test_a_link_over_the_budget_builds_nothing_and_offers_a_setting_that_fits(traced, monkeypatch):
    loaded, loaded_tc = traced
    prompt = PROMPT + " and the dog sat on the log and the bird sat on the tree"
    every = attribution_plan(loaded, loaded_tc, tuple(loaded.model.to_tokens(prompt)[0].tolist()), (10, 0.95, 0, 256))
    budget = every.bytes - MiB   # every feature does not fit; the forward copies and some features do
    monkeypatch.setattr(attribution_results, "ATTRIBUTION_BUDGET", budget)
    built = []
    real_attribute = attribution_results.attribute
    monkeypatch.setattr(attribution_results, "attribute", lambda *a, **k: built.append(k) or real_attribute(*a, **k))
    at = AppTest.from_file(str(APP / "pages" / "13_Attribution.py"), default_timeout=120)
    at.session_state["model_source"] = MODEL
    at.session_state["prompt"] = prompt
    for key, value in {"attribution_tc_source": "A path on this machine", "attribution_tc_path": PLT,
                       "attribution_max_features": "0", "attribution_corpus": "false"}.items():
        at.query_params[key] = value
    at.run()
    at.button(key="attribution_open_tc").click().run()
    assert not at.exception, [e.value for e in at.exception]
    planned, stated = attribution_results.AttributionPlan(every.bytes, budget, None).sizes()
    assert any(f"could take {planned}" in w.value and f"over the page's budget of {stated}; it is not built" in w.value
               for w in at.warning), [w.value for w in at.warning]
    assert built == [] and not at.get("plotly_chart")
    offer = at.button(key="attribution_fit_budget")
    fits = int(offer.label.split()[1])
    assert 0 < fits < every.bytes
    offer.click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.number_input(key="attribution_max_features").value == fits
    assert [k["max_feature_nodes"] for k in built] == [fits] and at.get("plotly_chart")


def test_links_start_corpus_passes_only_over_a_bounded_set_of_corpus_sizes(monkeypatch):
    """Every "Windows" value a link could ask for (8..4096 in steps of 8; the card's widget offers only
    CORPUS_WINDOW_COUNTS) and every window length: the passes run, each of which writes one cache file, use at most
    CORPUS_WINDOW_COUNTS x the lengths."""
    passes = set()

    def record(model, sae, n_windows, window, progress):
        passes.add((n_windows, window))
        return (n_windows, window)
    monkeypatch.setattr(feature_results.features, "feature_corpus_stats", record)
    model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=16, n_ctx=64))
    loaded = LoadedModel(model, "corpus-bound|eager")
    sae = feature_results.LoadedSAE(wb.SAE(wb.SAEConfig("standard", d_in=8, d_sae=4)), "corpus-bound-sae")
    no_bar = lambda text: ((lambda done, total: None), (lambda: None))   # noqa: E731
    for n_windows in range(8, 4097, 8):
        for window in (32, 64, 128):
            ran = feature_results.feature_corpus_stats(loaded, sae, n_windows, window, bar=no_bar)
            assert ran[0] >= min(n_windows, 4096) and ran[1] <= model.cfg.n_ctx
    assert {n for n, _ in passes} <= set(feature_results.CORPUS_WINDOW_COUNTS)
    assert len(passes) <= len(feature_results.CORPUS_WINDOW_COUNTS) * 3

