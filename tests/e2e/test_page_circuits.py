"""The Circuits page in a real browser on the toy attention model: a link names the task and the settings, a click
finds the circuit, plotly draws it with a clickable marker per edge, and a click on an edge's marker opens that edge's
card (its exact patching effect and its heads' patterns).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlencode, urlparse

import pytest

from tests.e2e.dashboard import click_points_until_heading_changes, wait_chart, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EDGE_HEADING = re.compile(r"^Edge ")   # the edge card's heading (not "The circuit's edges")


def test_a_linked_circuit_draws_and_a_click_opens_an_edge(browser, server_url, screenshot):
    query = urlencode({"model": "toy-attn-2l", "circuits_task": "induction", "circuits_n": 4, "circuits_seq_len": 6,
                       "circuits_method": "eap", "circuits_top_n": 20})
    page = browser.new_page(viewport={"width": 1400, "height": 2400})
    page.set_default_timeout(90_000)
    try:
        page.goto(f"{server_url}/Circuits?{query}")
        page.get_by_role("button", name="Find the circuit").click()
        wait_chart(page, "circuits_graph", timeout_ms=90_000)
        wait_idle(page)
        effect = page.locator('[data-testid="stMetric"]').filter(has_text="Exact patching effect")
        assert effect.count() == 1
        points = page.locator(".st-key-circuits_graph_chart .scatterlayer .trace .points path")
        assert points.count() > 20                      # 20 edge markers, then the nodes
        screenshot(page, "circuits_graph")
        header, now = click_points_until_heading_changes(page, "circuits_graph", EDGE_HEADING)  # another edge's card
        assert now != header, "no click on the graph opened another edge"
        assert parse_qs(urlparse(page.url).query)["circuits_edge"] == [now.removeprefix("Edge ")]   # linked
        assert page.locator('[data-testid="stException"]').count() == 0
    finally:
        page.close()
