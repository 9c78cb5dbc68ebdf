"""A researcher's session in a real browser: `streamlit run` on a free loopback port, Debian's
Chromium driven by Playwright. Types a prompt, waits for the heatmaps, moves the layer, runs an
ablation, visits every page on the default model (SmolLM2-135M when installed) and saves a
screenshot of each under the test's tmp_path and test-output/screenshots/.
"""

from __future__ import annotations

import pytest

import workbench as wb
from tests.e2e.dashboard import open_page, set_prompt, wait_chart, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."


def assert_no_traceback(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, "a Python traceback is on the page"


def metric_value(page, label: str) -> str:
    return page.locator('[data-testid="stMetric"]', has_text=label).locator('[data-testid="stMetricValue"]').inner_text()


def download(page, button_key: str, tmp_path) -> bytes:
    with page.expect_download(timeout=60_000) as info:
        page.locator(f".st-key-{button_key} button").first.click()
    path = tmp_path / info.value.suggested_filename
    info.value.save_as(path)
    return path.read_bytes()


def check_downloads(page, key: str, tmp_path) -> None:
    """The figure's HTML download is a standalone plotly page; its PNG (kaleido, when installed) is a PNG."""
    assert b"Plotly.newPlot" in download(page, f"{key}_html", tmp_path)
    if page.locator(f".st-key-{key}_png button").count():
        assert download(page, f"{key}_png", tmp_path).startswith(b"\x89PNG")
    assert download(page, "induction_top_csv", tmp_path).startswith(b"layer,head,score")


def test_researcher_session(browser, server_url, screenshot, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 2400})  # tall: Streamlit scrolls inside the page
    page.set_default_timeout(90_000)
    page.goto(server_url)
    page.get_by_text("Hook points").wait_for()  # the model card: the default model has loaded
    wait_idle(page)
    assert_no_traceback(page)
    screenshot(page, "1_home")

    open_page(page, "Attention", "Attention patterns")
    wait_chart(page, "layer_patterns", "Layer 0: every head")
    set_prompt(page, PROMPT)
    assert "fox" in page.locator(".st-key-prompt_tokens").inner_text()
    for key in ("layer_patterns", "pattern_grid"):
        wait_chart(page, key)
    page.locator(".st-key-attention_focus_head").click()  # one head, drawn larger on request
    page.get_by_role("option", name="L0H3").click()
    wait_chart(page, "focus_pattern", "L0H3")
    page.locator(".st-key-attention_layer input[type=range]").focus()
    page.keyboard.press("ArrowRight")
    wait_chart(page, "layer_patterns", "Layer 1: every head")
    wait_idle(page)
    assert_no_traceback(page)
    screenshot(page, "2_attention")

    open_page(page, "Heads", "Compare heads across layers")
    for key in ("heads_induction", "heads_left_pattern", "heads_right_pattern"):
        wait_chart(page, key)
    wait_idle(page)
    assert_no_traceback(page)
    screenshot(page, "3_heads")

    open_page(page, "Induction", "Induction heads")
    wait_chart(page, "induction_scores")
    wait_chart(page, "induction_loss")
    wait_idle(page)
    assert_no_traceback(page)
    screenshot(page, "4_induction")
    check_downloads(page, "induction_scores", tmp_path)

    open_page(page, "Ablation", "Ablation")
    wait_chart(page, "ablation_per_token")
    wait_idle(page)
    one_head = metric_value(page, "Mean loss, ablated")
    page.get_by_text("Attention layers", exact=True).click()  # ablate the whole attention layer 0 instead
    page.wait_for_function(
        "(before) => { const m = [...document.querySelectorAll('[data-testid=\"stMetric\"]')]"
        ".find(e => e.textContent.includes('Mean loss, ablated'));"
        " return m && m.querySelector('[data-testid=\"stMetricValue\"]').textContent !== before; }", arg=one_head)
    wait_idle(page)
    assert float(metric_value(page, "Mean loss, ablated")) != float(one_head)
    assert float(metric_value(page, "Mean loss, ablated")) != float(metric_value(page, "Mean loss, clean"))
    assert_no_traceback(page)
    screenshot(page, "5_ablation")

    open_page(page, "Logit lens", "Logit lens")
    wait_chart(page, "logit_lens")
    wait_chart(page, "dla", "Direct logit attribution")
    wait_idle(page)
    assert_no_traceback(page)
    screenshot(page, "6_logit_lens")

    open_page(page, "Router", "Mixture-of-experts router")
    wait_idle(page)
    models = wb.list_models().set_index("name")
    if models.loc["toy-moe-2l", "installed"]:
        open_page(page, "Home", "Mechanistic-interpretability workbench")
        page.locator(".st-key-home_name").click()
        page.get_by_role("option", name="toy-moe-2l").click()
        page.get_by_role("button", name="Open model").click()
        page.get_by_text("mixture of experts, top-2").wait_for()
        open_page(page, "Router", "Mixture-of-experts router")
        wait_chart(page, "expert_load")
        wait_idle(page)
    else:
        page.get_by_text("no mixture of experts").wait_for()
    assert_no_traceback(page)
    screenshot(page, "7_router")
    page.close()
