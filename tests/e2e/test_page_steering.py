"""The Steering page in a real browser on SmolLM2: a CAA vector from the typed contrast pairs the link carries,
the clean and steered continuations checked against ``experiments.steering.continue_with_vector`` run in this
process, the coefficient sweep drawn with the scores ``coefficient_sweep`` gives, every choice kept in the link,
and a screenshot.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlencode, urlparse

import pytest

import workbench as wb
from app.results.steering import DEFAULT_PAIRS, coefficients, parse_pairs
from experiments.steering import coefficient_sweep, continue_with_vector, logit_difference, train_steering_vector
from tests.e2e.dashboard import page_messages, wait_chart, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "I watched the new film last night and I thought it was"
LAYER, COEFFICIENT, NEW_TOKENS = 9, 8.0, 12


@pytest.fixture(scope="module")
def model():
    return wb.load_model("smollm2-135m")


def assert_no_traceback(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, "a Python traceback is on the page"
    assert not page.get_by_text("Something went wrong").count(), page_messages(page)


def metric_value(page, label: str) -> str:
    return page.locator('[data-testid="stMetric"]', has_text=label).locator('[data-testid="stMetricValue"]').inner_text()


def test_steering_page(browser, server_url, screenshot, model):
    page = browser.new_page(viewport={"width": 1400, "height": 2600})
    page.set_default_timeout(90_000)
    link = {"prompt": PROMPT, "steering_source": "Typed contrast pairs", "steering_pairs": DEFAULT_PAIRS,
            "steering_method": "caa", "steering_layers": f"[{LAYER}]", "steering_coefficient": str(COEFFICIENT),
            "steering_new_tokens": str(NEW_TOKENS), "steering_measure": "logit difference",
            "steering_tokens": " good, bad", "steering_range": "[-8.0, 8.0]", "steering_points": "5"}
    page.goto(f"{server_url}/Steering?" + urlencode(link))
    page.get_by_role("heading", name="Steering").wait_for()
    wait_idle(page)
    assert_no_traceback(page)

    vector = train_steering_vector(model, parse_pairs(DEFAULT_PAIRS), layers=[LAYER], method="caa")
    expected = continue_with_vector(model, vector, PROMPT, COEFFICIENT, max_new_tokens=NEW_TOKENS)
    page.locator(".st-key-steering_generate button").click()
    page.locator(".st-key-steering_steered").wait_for()
    wait_idle(page)
    page.wait_for_function("() => ['clean', 'steered'].every(side => { const e = document.querySelector("
                           "'.st-key-steering_' + side); return e && e.innerText.trim().length > 0; })")
    assert_no_traceback(page)
    assert page.locator(".st-key-steering_clean").inner_text().split() == expected.clean_text.split()
    assert page.locator(".st-key-steering_steered").inner_text().split() == expected.ablated_text.split()
    assert expected.first_divergence is not None   # the vector changes the continuation
    assert metric_value(page, "First divergence") == f"step {expected.first_divergence}"

    page.locator(".st-key-steering_run_sweep button").click()
    wait_chart(page, "steering_sweep", "Behaviour against the coefficient")
    wait_idle(page)
    assert_no_traceback(page)
    values = coefficients(-8.0, 8.0, 5)
    table = coefficient_sweep(model, vector, PROMPT, logit_difference(" good", " bad"), values)
    shown = page.evaluate("() => { const gd = document.querySelector('.st-key-steering_sweep_chart .js-plotly-plot');"
                          " const mean = gd.data[gd.data.length - 1]; return [Array.from(mean.x), Array.from(mean.y)]; }")
    assert shown[0] == pytest.approx(values)
    assert shown[1] == pytest.approx(table.score.tolist(), abs=2e-3)

    query = parse_qs(urlparse(page.url).query)   # every choice is in the link
    for key in ("steering_source", "steering_pairs", "steering_method", "steering_layers", "steering_coefficient",
                "steering_new_tokens", "steering_measure", "steering_tokens", "steering_range", "steering_points"):
        assert key in query, key
    assert query["steering_layers"] == [f"[{LAYER}]"] and query["steering_method"] == ["caa"]
    page.locator(".st-key-steering_sweep_chart").scroll_into_view_if_needed()
    screenshot(page, "16_steering")
    page.close()
