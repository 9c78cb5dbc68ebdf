"""The Patching and Generate pages in a real browser on SmolLM2: the numbers they show are checked against
the model run directly in this process (a hand-computed logit difference, ``experiments.patching`` and
``experiments.continuations``), a click on a heads-map cell shows that head's pattern, and a screenshot
of each page is saved.
"""

from __future__ import annotations

from urllib.parse import parse_qs, quote, urlencode, urlparse

import pytest
import torch

import workbench as wb
from experiments import patching
from experiments.continuations import continue_with_ablation
from tests.e2e.dashboard import ScriptRuns, wait_chart, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

IOI_CLEAN = "When Mary and John went to the store, John gave a drink to"
IOI_CORRUPT = "When Mary and John went to the store, Mary gave a drink to"
OTHER_CLEAN = "When Tom and Anna sat in the garden, Anna handed a cup to"  # where the page opens first
OTHER_CORRUPT = "When Tom and Anna sat in the garden, Tom handed a cup to"
GENERATE_PROMPT = "When Mary and John went to the store, John gave a drink to"
ABLATED_HEAD = (0, 3)  # zero-ablating it changes SmolLM2's greedy continuation of the prompt above


@pytest.fixture(scope="module")
def model():
    return wb.load_model("smollm2-135m")


def assert_no_traceback(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, "a Python traceback is on the page"
    assert not page.get_by_text("Something went wrong").count()


def metric_value(page, label: str) -> str:
    return page.locator('[data-testid="stMetric"]', has_text=label).locator('[data-testid="stMetricValue"]').inner_text()


@torch.no_grad()
def logit_diff(model, text: str, answer: str = " Mary", wrong: str = " John") -> float:
    logits_V = model(model.to_tokens(text))[0, -1]
    return float(logits_V[model.to_single_token(answer)] - logits_V[model.to_single_token(wrong)])


def set_text_area(page, key: str, text: str) -> None:
    box = page.locator(f".st-key-{key} textarea")
    box.fill(text)
    box.press("Control+Enter")


def _set_input(page, key: str, text: str) -> None:
    page.locator(f".st-key-{key} input").fill(text)
    page.locator(f".st-key-{key} input").press("Enter")


def test_patching_page(browser, server_url, screenshot, model):
    page = browser.new_page(viewport={"width": 1400, "height": 2600})
    page.set_default_timeout(90_000)
    runs = ScriptRuns(page)
    page.goto(f"{server_url}/Patching?" + urlencode({"patching_clean": OTHER_CLEAN, "patching_corrupt": OTHER_CORRUPT,
                                                     "patching_answer": " Anna", "patching_wrong": " Tom"}))
    page.get_by_role("heading", name="Activation patching").wait_for()
    wait_chart(page, "patching_heads_attribution")
    wait_idle(page)
    before = metric_value(page, "Clean logit diff")
    assert float(before) == pytest.approx(logit_diff(model, OTHER_CLEAN, " Anna", " Tom"), abs=2e-3)

    # The default IOI pair, typed in; attribution patching runs at once. Each edit waits for the run it starts, as a
    # user would see it land: an edit typed while the previous run redraws the page can be overwritten by that
    # run's copy of the box (the corrupted prompt was once lost so, in a loaded CI run).
    for edit in (lambda: set_text_area(page, "patching_clean", IOI_CLEAN),
                 lambda: set_text_area(page, "patching_corrupt", IOI_CORRUPT),
                 lambda: _set_input(page, "patching_answer", " Mary"),
                 lambda: _set_input(page, "patching_wrong", " John")):
        before = runs.done
        edit()
        runs.wait_after(page, before)
    clean, corrupt = logit_diff(model, IOI_CLEAN), logit_diff(model, IOI_CORRUPT)
    # Each edit reruns the page: wait for the run that has all four (the first rerun, after the prompts alone,
    # already changes the metric, with the old answer and wrong tokens).
    page.wait_for_function(
        "(expected) => { const m = [...document.querySelectorAll('[data-testid=\"stMetric\"]')]"
        ".find(e => e.textContent.includes('Clean logit diff'));"
        " return m && Math.abs(parseFloat(m.querySelector('[data-testid=\"stMetricValue\"]').textContent)"
        " - expected) < 2e-3; }", arg=clean)
    wait_chart(page, "patching_heads_attribution")
    wait_idle(page)
    assert_no_traceback(page)
    assert float(metric_value(page, "Clean logit diff")) == pytest.approx(clean, abs=2e-3)
    assert float(metric_value(page, "Corrupted logit diff")) == pytest.approx(corrupt, abs=2e-3)
    approx = patching.attribution_patching(model, IOI_CLEAN, IOI_CORRUPT, " Mary", " John", sites=["heads"])
    assert approx.attrs["clean_metric"] == pytest.approx(clean, abs=1e-3)

    # Click a head's cell on the attribution heads map: its pattern is drawn under the maps.
    top = approx.loc[approx["attribution"].abs().idxmax()]
    layer, head = (5, 4) if (int(top["layer"]), int(top["head"])) != (5, 4) else (6, 2)  # not the default head
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    page.locator(".st-key-patching_heads_attribution_chart").scroll_into_view_if_needed()  # a click must be on screen
    area = page.locator(".st-key-patching_heads_attribution_chart .nsewdrag").first.bounding_box()
    page.mouse.click(area["x"] + area["width"] * (head + 0.5) / n_heads,
                     area["y"] + area["height"] * (layer + 0.5) / n_layers)
    wait_chart(page, "patching_head_pattern", f"L{layer}H{head}")
    wait_idle(page)
    assert_no_traceback(page)
    assert parse_qs(urlparse(page.url).query)["patching_head"] == [f"[{layer}, {head}]"]  # the link keeps the head
    page.locator(".st-key-patching_head_pattern_chart").scroll_into_view_if_needed()
    screenshot(page, "8_patching")
    page.close()


def test_generate_page(browser, server_url, screenshot, model):
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    page.set_default_timeout(90_000)
    heads = quote(f"[[{ABLATED_HEAD[0]}, {ABLATED_HEAD[1]}]]")
    page.goto(f"{server_url}/Generate?prompt={quote(GENERATE_PROMPT)}&ablation_kind=head&ablation_heads={heads}"
              "&ablation_method=zero&generate_mode=Greedy&generate_max_new_tokens=20")
    page.get_by_role("heading", name="Generate").wait_for()
    wait_idle(page)
    assert_no_traceback(page)
    page.locator(".st-key-generate_run button").click()
    page.locator(".st-key-generate_ablated").wait_for()
    wait_idle(page)
    assert_no_traceback(page)
    page.get_by_text(f"Ablated (zero: head L{ABLATED_HEAD[0]}H{ABLATED_HEAD[1]})").wait_for()  # the head in the link

    expected = continue_with_ablation(model, GENERATE_PROMPT, [("head", *ABLATED_HEAD)], "zero", max_new_tokens=20)
    shown_clean = page.locator(".st-key-generate_clean").inner_text()
    shown_ablated = page.locator(".st-key-generate_ablated").inner_text()
    assert shown_clean.split() == expected.clean_text.split()
    assert shown_ablated.split() == expected.ablated_text.split()
    assert expected.first_divergence is not None
    assert metric_value(page, "First divergence") == f"step {expected.first_divergence}"
    assert float(metric_value(page, "Log-prob, clean")) == pytest.approx(sum(expected.clean_logprobs), abs=2e-2)
    # The continuations part at the highlighted token.
    highlighted = page.locator(".st-key-generate_ablated span[style*=background]").first.inner_text()
    assert highlighted.strip() == expected.ablated_str_tokens[expected.first_divergence].strip()
    screenshot(page, "12_generate")
    page.close()
