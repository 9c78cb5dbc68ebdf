"""The Attribution graph page in a real browser: by default it traces SmolLM2 with its shipped transcoders (no
click); and on the committed circuit-tracer fixture (a tiny random Llama and
its per-layer transcoders): a link names the model and the transcoders, each opened by a click; the page then shows
circuit-tracer's replacement score, the graph drawn by plotly with a clickable point per node, a feature's card, and
a click on a feature in the graph opens that feature's card.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlparse

import pytest

from tests.e2e.dashboard import click_points_until_heading_changes, wait_chart, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "attribution"


def test_a_linked_graph_draws_and_a_click_opens_a_feature(browser, server_url, screenshot):
    query = urlencode({"model": str(FIXTURES / "tiny_llama"), "prompt": "the cat sat on the mat and",
                       "attribution_tc_source": "A path on this machine", "attribution_tc_path": str(FIXTURES / "plt"),
                       "attribution_max_logits": 5, "attribution_logit_prob": 0.8, "attribution_corpus": "false"})
    page = browser.new_page(viewport={"width": 1400, "height": 2400})
    page.set_default_timeout(180_000)   # a limit, not a rate: ~30 s alone, 100 s on a loaded 2-core machine
    try:
        page.goto(f"{server_url}/Attribution?{query}")
        # One click, then wait for its rerun to finish, as a user would: a second click while the first rerun runs
        # stops that rerun, and Streamlit drops the first button's press if it had not yet been read.
        page.get_by_role("button", name="Open the linked model").click()
        page.get_by_role("button", name="Open the linked model").wait_for(state="detached")
        wait_idle(page, 180_000)
        page.get_by_role("button", name="Open these transcoders").click()
        wait_chart(page, "attribution_graph", timeout_ms=180_000)
        wait_idle(page)
        expected = json.loads((FIXTURES / "expected_plt.json").read_text())["replacement_score"]
        score = page.locator('[data-testid="stMetric"]').filter(has_text="Replacement score")
        assert f"{expected:.4f}" in score.inner_text()
        points = page.locator(".st-key-attribution_graph_chart .scatterlayer .trace .points path")
        assert points.count() > 5
        screenshot(page, "attribution_graph")
        header, now = click_points_until_heading_changes(page, "attribution_graph", "Feature")
        assert now != header, "no click on the graph opened another feature"
        assert page.locator('[data-testid="stException"]').count() == 0
    finally:
        page.close()


def test_the_default_page_traces_smollm2_with_its_shipped_transcoders(browser, server_url, screenshot):
    try:
        import workbench as wb

        wb.load_model("smollm2-135m", progress=False)
    except wb.CheckpointError as error:
        pytest.skip(f"SmolLM2 is not installed: {error}")
    page = browser.new_page(viewport={"width": 1400, "height": 2400})
    page.set_default_timeout(180_000)   # a limit, not a rate: SmolLM2's graph on a loaded 2-core machine
    try:
        # No transcoder parameter in the link: the shipped set is picked and traced with no click. A short prompt and
        # the corpus scan off keep the graph to tens of seconds on a busy 2-core machine (a 30-token one took 300 s).
        query = urlencode({"model": "smollm2-135m", "prompt": "The capital of France is", "attribution_corpus": "false"})
        page.goto(f"{server_url}/Attribution?{query}")
        wait_chart(page, "attribution_graph", timeout_ms=420_000)
        wait_idle(page, 420_000)   # the rest of the page (the picked feature's card) follows the graph
        # The picker's choice is in the link, as every choice (a select box shows its value in an input, not as text).
        picked = parse_qs(urlparse(page.url).query).get("attribution_tc_source", [""])[0]
        assert picked.startswith("smollm2-135m-skip-transcoders"), page.url
        for label in ("Replacement score", "Completeness score"):
            score = page.locator('[data-testid="stMetric"]').filter(has_text=label)
            value = float(score.locator('[data-testid="stMetricValue"]').inner_text())
            assert 0.0 <= value <= 1.0, (label, value)
        points = page.locator(".st-key-attribution_graph_chart .scatterlayer .trace .points path")
        assert points.count() > 5
        screenshot(page, "attribution_default_smollm2")
        assert page.locator('[data-testid="stException"]').count() == 0
    finally:
        page.close()
