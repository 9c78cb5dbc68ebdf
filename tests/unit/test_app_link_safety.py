"""What a dashboard link can do: a model path in ``?model=`` is only offered (a click opens it,
nothing retries it), a registered name opens at once, and no query value can put a markdown link, an
image or an autolink into any rendered message (``app.safe_text.quoted``).

Runs the real pages under Streamlit's AppTest on the toy models (see test_app_pages.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import workbench as wb
from app import results
from app.safe_text import quoted
from tests.unit.test_app_features import A_PATH, random_sae
from tests.unit.test_app_neurons_token_view import cache_dir, dense_mlp  # noqa: F401
from tests.unit.test_app_pages import APP, PAGES, SHORT_PROMPT, assert_clean, dense, moe  # noqa: F401

HOSTILE = ("nope [Session expired: click to sign in](https://evil.example/phish) ![b](https://evil.example/b.png) "
           "<a href=\"https://evil.example/a\">a</a> www.evil.example ` `` **bold**\n\n[x](https://evil.example/2)")
# Markdown for the messages, a tag for the charts (plotly renders <a href> in labels); short enough for the toy models.
HOSTILE_PROMPT = '<a href="https://evil.example/a">a</a> [x](https://evil.example) ![i](https://evil.example/i.png)'
MESSAGE_KINDS = ("markdown", "caption", "error", "warning", "info", "success", "toast", "title", "header",
                 "subheader", "exception")
_RUN = re.compile(r"`+")


def outside_code_spans(markdown: str) -> str:
    """``markdown`` with every code span cut out (a run of n backticks up to the next run of exactly n)."""
    out, i = [], 0
    while i < len(markdown):
        run = _RUN.match(markdown, i)
        if run is None:
            out.append(markdown[i])
            i += 1
            continue
        closing = next((m for m in _RUN.finditer(markdown, run.end()) if len(m.group()) == len(run.group())), None)
        if closing is None:  # an unmatched run is literal backticks
            out.append(run.group())
            i = run.end()
        else:
            out.append(" ")
            i = closing.end()
    return "".join(out)


def rendered_markdown(at: AppTest) -> list[str]:
    """The markdown body of every message element the page drew, and every button's label."""
    texts = []
    for kind in MESSAGE_KINDS:
        for element in at.get(kind):
            texts.append(str(getattr(element, "value", "")))
    texts += [button.label for button in at.get("button")]
    return texts


def assert_no_injected_markup(at: AppTest, where: str) -> None:
    for text in rendered_markdown(at):
        plain = outside_code_spans(text)
        for bad in ("](", "![", "evil", "://", "www.", "<a ", "<img"):  # "evil": a message may cut the host short
            assert bad not in plain, f"{where}: {bad!r} outside a code span in {text!r}"
    for chart in at.get("plotly_chart"):  # plotly draws <a href> in titles and labels
        assert '<a href=\\"https://evil' not in chart.proto.spec and "<a href=\"https://evil" not in chart.proto.spec


@pytest.fixture
def toy_default(monkeypatch):
    """The dashboard's default model is the toy one (not SmolLM2) while a link's path waits for a click."""
    monkeypatch.setattr(wb, "default_model_name", lambda: "toy-attn-2l")


def open_link(page: str, **params: str) -> AppTest:
    at = AppTest.from_file(str(APP / PAGES[page]), default_timeout=90)
    for name, value in params.items():
        at.query_params[name] = value
    return at.run()


def test_quoted_keeps_every_value_inside_one_code_span():
    for value in (HOSTILE, "`", "``x``", " a ", "", "a\n\nb", "x" * 500):
        span = quoted(value)
        assert outside_code_spans(span).strip() == "", (value, span)
        assert "\n" not in span


def test_a_path_in_a_link_is_offered_not_opened_until_clicked(dense_mlp, toy_default, monkeypatch):
    loads = []
    real_load = results.load_model
    monkeypatch.setattr(results, "load_model", lambda source, impl: loads.append(source) or real_load(source, impl))
    at = open_link("home", model=dense_mlp, impl="eager")
    assert_clean(at)
    assert dense_mlp not in loads and at.session_state["model_source"] == "toy-attn-2l"
    assert any(quoted(dense_mlp, limit=300) in i.value for i in at.info)
    at.run()  # a rerun does not try it either
    assert dense_mlp not in loads and at.session_state["model_source"] == "toy-attn-2l"
    at.button(key="open_linked_model").click().run()
    assert_clean(at)
    assert loads[-1] == dense_mlp and at.session_state["model_source"] == dense_mlp
    assert at.session_state["attn_impl"] == "eager"
    assert not at.get("button") or "open_linked_model" not in [b.key for b in at.button]  # the offer is gone
    assert at.query_params["model"] == dense_mlp


def test_a_registered_name_in_a_link_opens_at_once(toy_default):
    at = open_link("attention", model="toy-moe-2l", prompt=SHORT_PROMPT)
    assert_clean(at)
    assert at.session_state["model_source"] == "toy-moe-2l"
    assert "open_linked_model" not in [b.key for b in at.button]


def test_a_registered_name_that_fails_to_load_is_not_retried_on_every_rerun(toy_default, monkeypatch):
    tries = []

    def broken(source, impl):
        tries.append(source)
        raise wb.CheckpointError(f"{source}: weights file not found")
    monkeypatch.setattr(results, "load_model", broken)
    at = open_link("attention", model="toy-moe-2l", prompt=SHORT_PROMPT)
    assert tries == ["toy-moe-2l"] and any("weights file not found" in e.value for e in at.error)
    at.run()
    at.run()
    assert tries == ["toy-moe-2l"] and any("weights file not found" in e.value for e in at.error)  # still said
    at.button(key="retry_model_load").click().run()
    assert tries == ["toy-moe-2l", "toy-moe-2l"]  # tried again only when asked


def test_the_hostile_model_link_is_shown_quoted_on_home(toy_default):
    at = open_link("home", model=HOSTILE, impl=HOSTILE)
    assert_clean(at)
    assert at.session_state["model_source"] == "toy-attn-2l"
    assert_no_injected_markup(at, "home")
    at.button(key="open_linked_model").click().run()  # opened by hand: the load error quotes it too
    assert any("Could not load model" in e.value for e in at.error)
    assert_no_injected_markup(at, "home after the click")


def _linked_keys(page: str, source: str) -> list[str]:
    """Every query parameter the page writes (its linked widgets), found by running it once."""
    at = AppTest.from_file(str(APP / PAGES[page]), default_timeout=90)
    at.session_state["model_source"] = source
    at.session_state["prompt"] = SHORT_PROMPT
    at.run()
    return [key for key in at.query_params if key not in ("model", "impl")]


@pytest.fixture(scope="module")
def dense_mlp_sae(dense_mlp, tmp_path_factory) -> str:
    """An SAE for ``dense_mlp`` (random weights), so the Features page goes on to read its other linked values."""
    return str(random_sae(wb.load_model(dense_mlp, progress=False).cfg.d_model).save(tmp_path_factory.mktemp("sae")))


FEATURE_KEYS = {"features_sae_source", "features_sae_path", "features_feature", "features_norm_gain", "features_corpus",
                "features_windows", "features_window_len", "features_steer_mode", "features_steer_value",
                "features_steer_tokens"}

ATTRIBUTION_KEYS = {"attribution_tc_source", "attribution_tc_path", "attribution_max_logits", "attribution_logit_prob",
                    "attribution_max_features", "attribution_node_threshold", "attribution_edge_threshold",
                    "attribution_node", "attribution_pinned", "attribution_edge", "attribution_edit",
                    "attribution_amount", "attribution_freeze", "attribution_norm_gain", "attribution_corpus",
                    "attribution_windows", "attribution_window_len"}
CIRCUITS_KEYS = {"circuits_task", "circuits_n", "circuits_seed", "circuits_seq_len", "circuits_names", "circuits_clean",
                 "circuits_corrupt", "circuits_answer", "circuits_wrong", "circuits_method", "circuits_ig_steps",
                 "circuits_size", "circuits_top_n", "circuits_threshold", "circuits_ablation", "circuits_min_score",
                 "circuits_edge"}
TRACED = Path(__file__).resolve().parents[1] / "fixtures" / "attribution"   # a model with transcoders that fit


@pytest.mark.parametrize("page", sorted(PAGES))
def test_hostile_query_values_render_no_link_or_image(page, dense_mlp, dense_mlp_sae):
    keys = set(_linked_keys(page, dense_mlp)) | {"prompt"}
    if page in ("ablation", "token_view", "generate"):
        keys |= {"ablation_neurons"}
    if page == "patching":
        keys |= {"patching_answer", "patching_wrong"}
    if page == "features":
        keys |= FEATURE_KEYS
    if page == "attribution":
        keys |= ATTRIBUTION_KEYS
    if page == "circuits":
        keys |= CIRCUITS_KEYS
    hostile = {key: HOSTILE for key in keys}
    # A prompt that fits the toy model's context, so the page goes on to read its other linked values.
    cases = [hostile, {**hostile, "prompt": SHORT_PROMPT}, {**hostile, "prompt": HOSTILE_PROMPT}]
    if "ablation_kind" in keys:  # a right kind draws the neuron box, whose hostile value is then read
        cases.append({**hostile, "ablation_kind": "neuron", "prompt": SHORT_PROMPT})
    if page == "patching":  # the answer is checked first: a good answer lets the wrong token's value through
        cases.append({"patching_answer": " Mary", "patching_wrong": HOSTILE})
        cases.append({"patching_clean": HOSTILE, "patching_corrupt": HOSTILE})
    if page == "lens":
        cases.append({"prompt": SHORT_PROMPT, "lens_target": HOSTILE, "lens_baseline": HOSTILE})
    if page == "features":  # a good SAE lets the feature card's hostile values through
        cases.append({**hostile, "features_sae_source": A_PATH, "features_sae_path": dense_mlp_sae,
                      "prompt": SHORT_PROMPT})
    if page == "attribution":  # transcoders that fit let the graph's and the card's hostile values through
        cases.append({**hostile, "attribution_tc_source": A_PATH, "attribution_tc_path": str(TRACED / "plt"),
                      "prompt": "the cat sat on the mat and", "_model": str(TRACED / "tiny_llama"),
                      "attribution_corpus": "false"})
    if page == "circuits":  # each task's own boxes, and a good pair that lets the wrong token's value through
        cases += [{**hostile, "circuits_task": "pair"}, {**hostile, "circuits_task": "ioi"},
                  {**hostile, "circuits_task": "pair", "circuits_answer": " the"},
                  {**hostile, "circuits_task": "induction", "circuits_n": "2", "circuits_seq_len": "4", "_run": "yes"}]
    for params in cases:
        run = params.pop("_run", None)
        at = AppTest.from_file(str(APP / PAGES[page]), default_timeout=90)
        at.session_state["model_source"] = params.pop("_model", dense_mlp)
        for key, value in params.items():
            at.query_params[key] = value
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        assert_no_injected_markup(at, f"{page} {sorted(params)}")
        if run:  # the circuit found: the graph's and the edge card's hostile values read
            at.button(key="circuits_run").click().run()
            assert not at.exception, [e.value for e in at.exception]
            assert_no_injected_markup(at, f"{page} {sorted(params)} after finding the circuit")
            assert [h.value for h in at.header if h.value.startswith("Edge ")] and at.get("plotly_chart")
        if params.get("features_sae_path") == dense_mlp_sae:  # opened by a click: the card is drawn, its values read
            at.button(key="features_open_sae").click().run()
            assert not at.exception, [e.value for e in at.exception]
            assert_no_injected_markup(at, f"{page} {sorted(params)} after opening the SAE")
            assert [h.value for h in at.header if h.value.startswith("Feature ")]
        if params.get("attribution_tc_path") == str(TRACED / "plt"):  # opened by a click: graph and card drawn
            at.button(key="attribution_open_tc").click().run()
            assert not at.exception, [e.value for e in at.exception]
            assert_no_injected_markup(at, f"{page} {sorted(params)} after opening the transcoders")
            assert [h.value for h in at.header if h.value.startswith("Feature ")] and at.get("plotly_chart")
