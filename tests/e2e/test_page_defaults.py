"""Defaults that find the answer, in a real browser on SmolLM2: BOS is left out of the Attention page's colour
scale, the layer x head grid's range follows a new prompt, and pressing Enter twice in the Ablation page's head
picker selects nothing extra (no "Select all").
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs, quote, urlparse

import pytest

import workbench as wb
from experiments.attention import attention_patterns
from tests.e2e.dashboard import set_prompt, wait_chart, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "The Eiffel Tower is in the city of"
LAYER = 5  # past the first layers, where SmolLM2's heads sink their attention on BOS
# 64 tokens or so: at 9 heads x P^2 cells a layer, the grid's cell budget (150,000) fits only a few layers.
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 7)


@pytest.fixture(scope="module")
def model():
    return wb.load_model("smollm2-135m")


def query(page) -> dict[str, list[str]]:
    return parse_qs(urlparse(page.url).query)


def assert_no_traceback(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, "a Python traceback is on the page"
    assert not page.get_by_text("Something went wrong").count()


def test_bos_is_out_of_the_attention_colour_scale(browser, server_url, model):
    page = browser.new_page(viewport={"width": 1500, "height": 2400})
    page.set_default_timeout(90_000)
    page.goto(f"{server_url}/Attention?model=smollm2-135m&prompt={quote(PROMPT)}&attention_layer={LAYER}")
    wait_chart(page, "layer_patterns", f"Layer {LAYER}", timeout_ms=180_000)  # the first page: SmolLM2 loads
    wait_idle(page)
    assert_no_traceback(page)
    shown_max = page.evaluate("() => document.querySelector('.st-key-layer_patterns_chart .js-plotly-plot')"
                              "._fullLayout.coloraxis.cmax")
    patterns_HPS = attention_patterns(model, PROMPT)[LAYER].float()
    assert model.to_tokens(PROMPT)[0, 0].item() == model.tokenizer.bos_token_id
    # By hand: every cell but BOS's row (the query that can only see itself) and BOS's column (the sink).
    expected = float(patterns_HPS[:, 1:, 1:].max())
    assert shown_max == pytest.approx(expected, abs=1e-3)
    assert float(patterns_HPS[:, 1:, 0].max()) > shown_max  # the sink's column would have set the scale
    page.close()


def test_the_grid_range_follows_a_new_prompt(browser, server_url, model):
    page = browser.new_page(viewport={"width": 1500, "height": 2400})
    page.set_default_timeout(120_000)
    page.goto(f"{server_url}/Attention?model=smollm2-135m&prompt={quote(LONG_PROMPT)}")
    wait_chart(page, "pattern_grid", timeout_ms=180_000)
    wait_idle(page)
    n_tokens, cfg = model.to_tokens(LONG_PROMPT).shape[1], model.cfg
    fits = 150_000 // (cfg.n_heads * n_tokens * n_tokens)
    first, last = json.loads(query(page)["attention_grid_layers"][0])
    assert last - first + 1 == fits < cfg.n_layers  # a long prompt: only part of the model fits
    set_prompt(page, PROMPT)  # 9 tokens x 9 x 9 heads x 30 layers: the whole model fits the budget
    wait_chart(page, "pattern_grid")
    wait_idle(page)
    assert json.loads(query(page)["attention_grid_layers"][0]) == [0, cfg.n_layers - 1]
    assert_no_traceback(page)
    page.close()


def test_enter_twice_in_the_head_picker_selects_nothing_extra(browser, server_url, model):
    page = browser.new_page(viewport={"width": 1500, "height": 1600})
    page.set_default_timeout(90_000)
    page.goto(f"{server_url}/Ablation?model=smollm2-135m&prompt={quote(PROMPT)}&ablation_kind=head"
              f"&ablation_heads={quote('[[23, 4]]')}")
    page.get_by_role("heading", name="Ablation").wait_for()
    picker = page.locator(".st-key-ablation_heads")
    picker.wait_for()
    wait_idle(page)
    picker.locator("input").click()
    page.keyboard.press("Enter")
    page.keyboard.press("Enter")
    page.wait_for_timeout(1500)  # a selection would start a rerun within this
    wait_idle(page)
    tags = picker.locator('[data-testid="stMultiSelectTagsContainer"] [data-tag]')
    assert tags.all_inner_texts() == ["L23H4"], "Enter added heads"
    assert "Select all" not in page.locator("body").inner_text()
    assert_no_traceback(page)
    page.close()
