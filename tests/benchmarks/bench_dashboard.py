"""Dashboard responsiveness in a real browser, on SmolLM2-135M.

Cold start: from launching `streamlit run` to the first attention heatmap drawn in Chromium
(server start, imports, loading the model, the first forward pass and the browser's drawing;
the browser itself is already open, as a user's would be). Re-render: from the key press that
applies a new prompt (Ctrl+Enter) or moves the layer slider (an arrow key) until the new
figures are drawn and Streamlit is idle, for prompts of up to 64 tokens. Goals: cold
start within 10 s, re-render within 1 s (the median).

    python tests/benchmarks/bench_dashboard.py [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks.common import script_main
from tests.e2e import dashboard

MODEL = "smollm2-135m"
COLD_START_GOAL_S, RERENDER_GOAL_S = 10.0, 1.0
PASSAGE = ("The history of the region goes back thousands of years. The first written records describe farmers, "
           "traders and travellers who crossed the river valley on their way to the coast, where small markets "
           "slowly grew into towns, and the towns into cities with walls, temples and harbours full of ships. ") * 3


def _prompts(lengths: tuple[int, ...], variants: int) -> list[tuple[int, str]]:
    """(length, text) pairs: ``variants`` different texts of exactly each length, cut from one passage.

    Every text differs, so each prompt change computes its patterns afresh (no cache hit).
    """
    import workbench as wb

    model = wb.load_model(MODEL, progress=False)
    ids = model.to_tokens(PASSAGE, prepend_bos=False)[0]
    prompts = []
    for n in lengths:
        for variant in range(variants):
            start = 5 * variant + n % 7  # different starting points give different texts
            # n - 1 text tokens plus the BOS the prompt box adds; decoding a cut can re-tokenize a little
            # differently, so a few lengths are tried until one gives exactly n tokens
            for cut in range(n - 1, n + 8):
                text = model.to_string(ids[start:start + cut])
                if model.to_tokens(text).shape[1] == n:
                    prompts.append((n, text))
                    break
            else:
                raise RuntimeError(f"could not make a prompt of exactly {n} tokens")
    return prompts


def _timed(action, done) -> float:
    start = time.perf_counter()
    action()
    done()
    return time.perf_counter() - start


def _cold_start(browser, log_dir: Path) -> tuple[float, object, object]:
    """Seconds from `streamlit run` to the first drawn heatmap; returns the live server and page too."""
    port = dashboard.free_port()
    log = open(log_dir / f"server-{port}.log", "w")
    start = time.perf_counter()
    server = dashboard.start_server(port, log)
    dashboard.wait_healthy(port, server, timeout=120)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"http://127.0.0.1:{port}/Attention")
    dashboard.wait_chart(page, "layer_patterns", "Layer 0: every head", timeout_ms=120_000)
    return time.perf_counter() - start, server, page


def _press_and_wait(page, key: str, expect_js: str, arg) -> float:
    def act():
        page.keyboard.press(key)

    def done():
        page.wait_for_function(expect_js, arg=arg, timeout=60_000)
        dashboard.wait_idle(page)

    return _timed(act, done)


def _rerenders(page, prompts: list[tuple[int, str]], layer_moves: int) -> list[tuple[str, int, float]]:
    """(what, tokens, seconds) for each prompt change and each layer move after it."""
    tokens_js = "() => { const e = document.querySelector('.st-key-prompt_tokens'); return e ? e.textContent : ''; }"
    title_js = ("(t) => [...document.querySelectorAll('.st-key-layer_patterns_chart .gtitle')]"
                ".some(e => e.textContent.includes(t))")
    slider = page.locator(".st-key-attention_layer input[type=range]")
    timings = []
    layer = 0
    for n, text in prompts:
        box = page.locator(".st-key-prompt textarea")
        box.fill(text)
        box.focus()
        before = page.evaluate(tokens_js)
        seconds = _press_and_wait(page, "Control+Enter", f"(before) => ({tokens_js})() !== before", before)
        assert page.evaluate(tokens_js).startswith(f"{n} tokens"), page.evaluate(tokens_js)[:40]
        timings.append(("prompt change", n, seconds))
        for _ in range(layer_moves):
            slider.focus()
            layer += 1
            timings.append(("layer change", n, _press_and_wait(page, "ArrowRight", title_js, f"Layer {layer}: every head")))
    return timings


def _row(measurement: str, values: list[float], goal: float, **extra) -> dict:
    return {"measurement": measurement, **extra, "median_s": statistics.median(values), "min_s": min(values),
            "max_s": max(values), "repeats": len(values), "goal_s": goal,
            "meets_goal": "yes" if statistics.median(values) <= goal else "no"}


def run(quick: bool = False) -> list[dict]:
    """Cold-start and re-render timings as table rows (``quick``: one cold start, one prompt length).

    Example:
        >>> rows = run(quick=True)   # doctest: +SKIP
        >>> rows[0]["measurement"]   # doctest: +SKIP
        'cold start to first attention heatmap'
    """
    reason = dashboard.browser_unavailable()
    if reason:
        raise RuntimeError(f"cannot benchmark the dashboard: {reason}")
    from playwright.sync_api import sync_playwright

    lengths = (64,) if quick else (16, 32, 64)
    prompts = _prompts(lengths, variants=1 if quick else 3)
    cold, rerenders, cold_tokens = [], [], 0
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as logs, sync_playwright() as playwright:
        browser = dashboard.launch_chromium(playwright)
        try:
            for attempt in range(1 if quick else 3):
                seconds, server, page = _cold_start(browser, Path(logs))
                cold.append(seconds)
                try:
                    if attempt == 0:
                        dashboard.wait_idle(page)
                        cold_tokens = int(page.locator(".st-key-prompt_tokens").inner_text().split()[0])
                        rerenders = _rerenders(page, prompts, layer_moves=2)
                finally:
                    page.close()
                    dashboard.stop_server(server)
        finally:
            browser.close()
    load = round(max(load_before, os.getloadavg()[0]), 1)
    rows = [_row("cold start to first attention heatmap", cold, COLD_START_GOAL_S, tokens=cold_tokens, load_avg_1min=load)]
    for what in ("prompt change", "layer change"):
        for n in lengths:
            values = [s for w, k, s in rerenders if w == what and k == n]
            rows.append(_row(f"{what} re-render", values, RERENDER_GOAL_S, tokens=n, load_avg_1min=load))
    return rows


if __name__ == "__main__":
    script_main(__name__, "Dashboard in Chromium, SmolLM2-135M", "one cold start and the 64-token prompt only")
