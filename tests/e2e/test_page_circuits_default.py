"""The Circuits page's default in a real browser on the dashboard's default model (SmolLM2-135M): opened with no
link parameter but the model, one click finds a circuit whose "Gap recovered" metric is at least half of the clean -
corrupt gap, with the sentence that says how faithful it is."""

from __future__ import annotations

import re

import pytest

import workbench as wb
from tests.e2e.dashboard import wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def smollm2_installed():
    try:
        wb.load_model("smollm2-135m", progress=False)
    except wb.CheckpointError as error:
        pytest.skip(f"SmolLM2 is not installed: {error}")


def test_the_default_circuit_recovers_at_least_half_the_gap(browser, server_url, screenshot, smollm2_installed):
    page = browser.new_page(viewport={"width": 1400, "height": 2400})
    page.set_default_timeout(180_000)   # a limit, not a rate: the first click scores every edge of SmolLM2
    try:
        page.goto(f"{server_url}/Circuits?model=smollm2-135m")
        page.get_by_role("button", name="Find the circuit").click()
        recovered = page.locator('[data-testid="stMetric"]').filter(has_text="Gap recovered")
        value = recovered.locator('[data-testid="stMetricValue"]')
        value.filter(has_text=re.compile(r"^-?\d+\.\d{4}$")).wait_for(timeout=180_000)
        assert float(value.inner_text()) >= 0.5
        assert page.get_by_text(re.compile(r"The circuit recovers \d+% of the gap")).count() == 1
        wait_idle(page, timeout_ms=180_000)    # the faithfulness curve follows
        screenshot(page, "circuits_default_smollm2")
        assert page.locator('[data-testid="stException"]').count() == 0
    finally:
        page.close()
