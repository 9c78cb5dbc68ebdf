"""The Neurons and Token view pages in a real browser on SmolLM2: pick a neuron and a token, and check
the numbers the pages show against ``run_with_cache`` and hand matmuls in this process.
"""

from __future__ import annotations

import re
from urllib.parse import urlencode

import pytest
import torch

import workbench as wb
from experiments.neurons import neuron_corpus
from tests.e2e.dashboard import wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
VALUES_JS = "els => els.map(e => e.dataset.value)"


@pytest.fixture(scope="module")
def smollm2():
    return wb.load_model("smollm2-135m").requires_grad_(False)


def assert_no_traceback(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, "a Python traceback is on the page"


def metric_value(page, label: str) -> str:
    label_box = page.locator('[data-testid="stMetricLabel"]').get_by_text(label, exact=True)
    return page.locator('[data-testid="stMetric"]').filter(has=label_box).locator('[data-testid="stMetricValue"]').inner_text()


def wait_metric_change(page, label: str, before: str) -> None:
    page.wait_for_function(
        "([label, before]) => { const m = [...document.querySelectorAll('[data-testid=\"stMetric\"]')]"
        ".find(e => e.querySelector('[data-testid=\"stMetricLabel\"]').textContent.trim() === label);"
        " return m && m.querySelector('[data-testid=\"stMetricValue\"]').textContent !== before; }",
        arg=[label, before], timeout=60_000)
    wait_idle(page)


def shown_values(page, key: str) -> list[float]:
    return [float(v) for v in page.locator(f".st-key-{key} span.wb-token").evaluate_all(VALUES_JS)]


def test_neurons_page_matches_a_direct_forward_and_the_unembedding(browser, server_url, screenshot, smollm2):
    model, layer, neuron = smollm2, 3, 100
    page = browser.new_page(viewport={"width": 1400, "height": 2600})
    query = urlencode({"prompt": PROMPT, "neurons_layer": layer, "neurons_windows": 16, "neurons_window_len": 32})
    page.goto(f"{server_url}/Neurons?{query}")
    page.get_by_role("heading", name="Neurons").wait_for(timeout=90_000)
    page.locator(".st-key-neurons_top_windows span.wb-token").first.wait_for(timeout=90_000)
    wait_idle(page)
    before = metric_value(page, "Max activation")

    box = page.locator(".st-key-neurons_neuron input")  # the main interaction: choose another neuron
    box.fill(str(neuron))
    box.press("Enter")
    wait_metric_change(page, "Max activation", before)
    page.locator(".st-key-neurons_top_windows span.wb-token").first.wait_for()
    assert_no_traceback(page)

    tokens = model.to_tokens(PROMPT)
    _, cache = model.run_with_cache(tokens, names_filter=f"blocks.{layer}.mlp.hook_post")
    acts_P = cache[f"blocks.{layer}.mlp.hook_post"][0, :, neuron]
    assert float(metric_value(page, "Max activation")) == pytest.approx(float(acts_P.max()), abs=2e-4)
    assert shown_values(page, "neurons_prompt") == pytest.approx(acts_P.tolist(), abs=1e-4)
    # The direct effect: W_out[neuron] times the final RMSNorm's gain, through W_U (a hand matmul).
    effect_V = (model.blocks[layer].mlp.W_out[neuron] * model.ln_final.w) @ model.W_U
    top_token = model.to_str_tokens(torch.tensor([int(effect_V.argmax())]))[0]
    assert metric_value(page, "Top promoted token") == repr(top_token)

    # The best corpus window: its outlined token's value is the max of a direct forward on that window.
    caption = page.locator(".st-key-neurons_top_windows").inner_text()
    window = int(re.search(r"#1 · window (\d+)", caption)[1])
    windows_BP = neuron_corpus(model, n_windows=16, window=32)
    _, alone = model.run_with_cache(windows_BP[window][None], names_filter=f"blocks.{layer}.mlp.hook_post")
    best = float(alone[f"blocks.{layer}.mlp.hook_post"][0, 1:, neuron].max())  # BOS left out
    first = page.locator(".st-key-neurons_top_windows .wb-token-view").first
    outlined = first.locator("span.wb-token[style*='outline']").get_attribute("data-value")
    assert float(outlined) == pytest.approx(best, rel=1e-4, abs=1e-4)
    screenshot(page, "11_neurons")
    page.close()


def test_token_view_shows_a_heads_pattern_row_and_column(browser, server_url, screenshot, smollm2):
    model, layer, head, token = smollm2, 2, 4, 5
    page = browser.new_page(viewport={"width": 1400, "height": 1600})
    query = urlencode({"prompt": PROMPT, "token_view_layer": layer, "token_view_head": head})
    page.goto(f"{server_url}/Token_view?{query}")
    page.get_by_role("heading", name="Token view").wait_for(timeout=90_000)
    page.locator(".st-key-token_view_text span.wb-token").first.wait_for(timeout=90_000)
    wait_idle(page)

    labels = model.to_str_tokens(model.to_tokens(PROMPT)[0])
    before = metric_value(page, "Selected token")
    page.locator(".st-key-token_view_token").click()  # the main interaction: select a token
    page.get_by_role("option", name=f"{token}: {labels[token]!r}", exact=True).click()
    wait_metric_change(page, "Selected token", before)
    assert metric_value(page, "Selected token") == f"{token}: {labels[token]!r}"

    _, cache = model.run_with_cache(model.to_tokens(PROMPT), names_filter=f"blocks.{layer}.attn.hook_pattern")
    pattern_PS = cache[f"blocks.{layer}.attn.hook_pattern"][0, head]
    assert shown_values(page, "token_view_text") == pytest.approx(pattern_PS[token].tolist(), abs=1e-5)
    assert float(metric_value(page, "Attention at the selected token")) == pytest.approx(
        float(pattern_PS[token, token]), abs=1e-4)
    assert_no_traceback(page)
    screenshot(page, "10_token_view")

    row = ",".join(page.locator(".st-key-token_view_text span.wb-token").evaluate_all(VALUES_JS))
    page.get_by_text("Paid to the selected token (its column)").click()  # the direction toggle
    page.wait_for_function(
        "(row) => [...document.querySelectorAll('.st-key-token_view_text span.wb-token')]"
        ".map(e => e.dataset.value).join() !== row", arg=row, timeout=60_000)
    wait_idle(page)
    assert shown_values(page, "token_view_text") == pytest.approx(pattern_PS[:, token].tolist(), abs=1e-5)
    assert_no_traceback(page)
    page.close()
