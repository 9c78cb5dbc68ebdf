"""The Information flow page in a real browser on SmolLM2: pick a token, move the threshold, and check the
node and edge counts and the top attention edge's importance against ``experiments.flow`` run directly in
this process; click a node in the graph and see its block's vocabulary projection; save a screenshot.
"""

from __future__ import annotations

from urllib.parse import parse_qs, quote, urlparse

import pytest

import workbench as wb
from experiments import flow
from tests.e2e.dashboard import wait_chart, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "When Mary and John went to the store, John gave a drink to"
POSITION = 9  # a token in the middle of the prompt (the page starts at the last one)
STEPS = 3  # threshold moves from 0.04 by three 0.01 steps


@pytest.fixture(scope="module")
def model():
    return wb.load_model("smollm2-135m")


@pytest.fixture(scope="module")
def contributions(model):
    return flow.flow_contributions(model, model.to_tokens(PROMPT))


def assert_no_traceback(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, "a Python traceback is on the page"
    assert not page.get_by_text("Something went wrong").count()


def metric_value(page, label: str) -> str:
    metric = page.locator('.st-key-flow_metrics [data-testid="stMetric"]').filter(has=page.get_by_text(label, exact=True))
    return metric.locator('[data-testid="stMetricValue"]').inner_text()


def assert_counts_match(page, contributions, position: int, threshold: float) -> None:
    nodes, edges = flow.flow_graph(contributions, position, threshold)
    assert int(metric_value(page, "Nodes")) == len(nodes)
    assert int(metric_value(page, "Edges")) == len(edges)
    attention = edges[edges["kind"] == "attention"]
    assert int(metric_value(page, "Attention edges")) == len(attention)
    if len(attention):
        assert float(metric_value(page, "Top attention edge")) == pytest.approx(attention["importance"].iloc[0], abs=2e-4)


def test_information_flow_page(browser, server_url, screenshot, model, contributions):
    page = browser.new_page(viewport={"width": 1500, "height": 2600})
    page.set_default_timeout(90_000)
    page.goto(f"{server_url}/Information_flow?prompt={quote(PROMPT)}")
    page.get_by_role("heading", name="Information flow").wait_for()
    labels = model.to_str_tokens(PROMPT)
    last = len(labels) - 1
    wait_chart(page, "flow_graph", f"into {last} ")
    wait_idle(page)
    assert_no_traceback(page)
    assert_counts_match(page, contributions, last, 0.04)

    # Pick a token: the graph now flows into it.
    page.locator(".st-key-flow_position").click()
    page.get_by_role("option", name=f"{POSITION}: {labels[POSITION]!r}", exact=True).click()
    wait_chart(page, "flow_graph", f"into {POSITION} ")
    wait_idle(page)
    assert_counts_match(page, contributions, POSITION, 0.04)

    # Move the threshold with the keyboard (0.01 a step): fewer edges survive.
    slider = page.locator(".st-key-flow_threshold input[type=range]")
    slider.focus()
    for _ in range(STEPS):
        page.keyboard.press("ArrowRight")
    threshold = round(0.04 + 0.01 * STEPS, 2)
    wait_chart(page, "flow_graph", f"≥ {threshold:.2f}")
    wait_idle(page)
    assert_counts_match(page, contributions, POSITION, threshold)
    assert_no_traceback(page)

    # Click the start node (the first point of the nodes trace): the Inspect box follows, the block's
    # promoted and suppressed tokens appear.
    node_points = page.locator(".st-key-flow_graph_chart .scatterlayer .trace").last.locator("path.point")
    box = node_points.first.bounding_box()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    start = f"L{model.cfg.n_layers - 1}.post:{POSITION}"
    detail = page.locator(".st-key-flow_detail")
    detail.get_by_text(f"{start}: what layer {model.cfg.n_layers - 1}'s MLP writes").wait_for()
    wait_idle(page)
    assert detail.get_by_text("Promoted").count() and detail.get_by_text("Suppressed").count()
    assert parse_qs(urlparse(page.url).query)["flow_pick"] == [start]  # the Inspect box (and the link) follow
    assert_no_traceback(page)
    screenshot(page, "9_information_flow")
    page.close()
