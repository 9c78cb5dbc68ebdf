"""Many users at once: six browser contexts on one dashboard server, each on its own page and model,
for at least two minutes (``WORKBENCH_LOAD_SECONDS``) and for as long as the checks below need on this
machine: until every context has shown each of its requests once (warm: every model loaded, every result
cached) and then each of them again, start to finish, after that moment. A slow or busy machine makes the
run longer, never the test fail (only past ``HARD_LIMIT_SECONDS`` is the server called too slow).

Every request opens a link (``/Page?model=...&prompt=...``: a fresh session each time) and reads one
number the page shows: Ablation, Logit lens, Patching and Neurons on SmolLM2-135M, Router on the MoE
toy model, Induction on the attention-only toy model. Between requests a user reads the page for
``THINK_SECONDS``. Checked:
- no page shows a traceback or an error;
- every number equals what the experiments functions compute for that model and prompt in this test
  process (what the page shows alone), and the same request always shows the same number, so nothing
  leaks between sessions through the shared model, its hooks or the caches;
- the server's resident memory stops growing once every model is loaded and every request has been
  served once (it grows by less than ``MEMORY_GROWTH_LIMIT`` from then on);
- afterwards no hook is attached to any model (the Home page's "Hooks attached now" reads 0).

The figures (contexts, requests served, peak memory) are printed for the closing note (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
import urllib.parse
from dataclasses import dataclass
from typing import Callable

import psutil
import pytest
import torch

import workbench as wb
from experiments import ablation, induction, lens, neurons, router
from tests.e2e import dashboard

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LOAD_SECONDS = float(os.environ.get("WORKBENCH_LOAD_SECONDS", "120"))
# A user reads a page before opening the next link. Back-to-back reloads of cached pages would add CPU load
# beside the rest of `make test`, not coverage.
THINK_SECONDS = float(os.environ.get("WORKBENCH_LOAD_THINK_SECONDS", "5"))
HARD_LIMIT_SECONDS = 1800  # a server this slow to serve each context's requests twice is broken, not busy
MEMORY_GROWTH_LIMIT = 150 * 2**20
# Two prompts per page: each context alternates between two numbers, so a value leaking from another request or
# session shows; more prompts would only lengthen the warm-up the run waits for (each is computed once).
PROMPTS = ["The cat sat on the mat and looked at the door.",
           "When Mary and John went to the store, John gave a drink to"]


@dataclass
class Scenario:
    """One context's work: a page on a model, the link parameters of each request, and how to read its number."""

    page: str
    model: str
    params: dict
    read: str  # a metric's label, or "caption:<regex>" for a number in a caption
    expected: Callable[[object, str, dict], str]  # (model, prompt, extra params) -> the number as the page shows it
    variants: list = None  # (prompt, extra params) per request; PROMPTS by default

    def requests(self) -> list[tuple[str, dict]]:
        return self.variants or [(p, {}) for p in PROMPTS]


def _ablated_loss(targets: list, method: str = "zero"):
    def expected(model, prompt: str, extra: dict) -> str:
        chosen = [ablation.AblationTarget(*t) for t in targets]
        return f"{ablation.per_token_loss_change(model, model.to_tokens(prompt), chosen, method)['ablated_loss'].mean():.4f}"
    return expected


def _dla_logit_diff(model, prompt: str, extra: dict) -> str:
    tokens = model.to_tokens(prompt)
    with torch.no_grad():
        target = int(model(tokens)[0, -1].argmax())
    dla = lens.direct_logit_attribution(model, tokens, target, None, tokens.shape[1] - 1)
    return f"{dla.attrs['logit_diff']:.4f}"


def _expert_ablated(model, prompt: str, extra: dict) -> str:
    return f"{router.expert_ablation_effect(model, model.to_tokens(prompt), 1, 0)['ablated_loss']:.4f}"


def _clean_logit_diff(model, prompt: str, extra: dict) -> str:
    with torch.no_grad():
        logits_V = model(model.to_tokens(extra["patching_clean"]))[0, -1]
    return f"{float(logits_V[model.to_single_token(' Mary')] - logits_V[model.to_single_token(' John')]):.4f}"


def _max_activation(model, prompt: str, extra: dict) -> str:
    return f"{neurons.neuron_activation(model, model.to_tokens(prompt), neurons.MLPUnit(2), 7)['activation'].max():.4f}"


IOI_PAIRS = [("When Mary and John went to the store, John gave a drink to",
              "When Mary and John went to the store, Mary gave a drink to"),
             ("After Mary and John met at the park, John handed a book to",
              "After Mary and John met at the park, Mary handed a book to")]


def _second_copy_loss(model, prompt: str, extra: dict) -> str:
    loss = induction.induction_loss(model, seq_len=12, batch=4, seed=int(extra["induction_seed"]))
    return f"{loss.groupby('copy')['loss'].mean()['second']:.3f}"


SCENARIOS = [
    Scenario("Ablation", "smollm2-135m", {"ablation_kind": "head", "ablation_heads": "[[3, 4]]",
                                          "ablation_method": "zero"},
             "Mean loss, ablated", _ablated_loss([("head", 3, 4)])),
    Scenario("Logit_lens", "smollm2-135m", {}, r"caption:logit difference (-?\d+\.\d+)", _dla_logit_diff),
    Scenario("Router", "toy-moe-2l", {"router_layer": "1", "router_expert": "0"}, "Mean loss without L1 expert 0",
             _expert_ablated),
    Scenario("Patching", "smollm2-135m", {"patching_source": "Prompt pair", "patching_answer": " Mary",
                                          "patching_wrong": " John"},
             "Clean logit diff", _clean_logit_diff,
             variants=[("", {"patching_clean": clean, "patching_corrupt": corrupt}) for clean, corrupt in IOI_PAIRS]),
    Scenario("Neurons", "smollm2-135m", {"neurons_layer": "2", "neurons_neuron": "7", "neurons_corpus": "false"},
             "Max activation", _max_activation),
    Scenario("Induction", "toy-attn-2l", {"induction_seq_len": "12", "induction_batch": "4"}, "Mean loss, second copy",
             _second_copy_loss, variants=[("", {"induction_seed": str(seed)}) for seed in range(3)]),
]


def _url(base: str, scenario: Scenario, prompt: str, extra: dict) -> str:
    params = {"model": scenario.model, **({"prompt": prompt} if prompt else {}), **scenario.params, **extra}
    return f"{base}/{scenario.page}?{urllib.parse.urlencode(params)}"


def _expected_values() -> dict:
    """What each request must show: the experiments functions on each model, in this process."""
    models, expected = {}, {}
    for index, scenario in enumerate(SCENARIOS):
        model = models.setdefault(scenario.model, wb.load_model(scenario.model, progress=False).eval())
        for prompt, extra in scenario.requests():
            expected[index, prompt, tuple(sorted(extra.items()))] = scenario.expected(model, prompt, extra)
    return expected


READ_JS = """([read]) => {
  if (document.querySelector('[data-testid="stStatusWidget"]') || document.querySelector('[data-stale="true"]')) return null;
  if (read.startsWith('caption:')) {
    const re = new RegExp(read.slice(8));
    for (const e of document.querySelectorAll('[data-testid="stCaptionContainer"]')) {
      const m = e.textContent.match(re); if (m) return m[1]; }
    return null; }
  const m = [...document.querySelectorAll('[data-testid="stMetric"]')].find(e => e.textContent.includes(read));
  return m ? m.querySelector('[data-testid="stMetricValue"]').textContent.trim() : null; }"""


async def _problems(page) -> list[str]:
    found = []
    if await page.locator('[data-testid="stException"]').count():
        found.append("traceback")
    for alert in await page.locator('[data-testid="stAlert"]').all_inner_texts():
        if "went wrong" in alert or "Could not" in alert or "does not fit" in alert:
            found.append(alert[:200])
    return found


class Progress:
    """What the contexts have served: the run lasts until it is warm (every context has shown each of its
    requests once) and every context has then shown each request again, start to finish, and at least
    ``LOAD_SECONDS`` have passed: the measured conditions the checks need, whatever the machine's speed."""

    def __init__(self, started: float):
        self.started, self.warm_at = started, None
        self.first = [set() for _ in SCENARIOS]
        self.after_warm = [set() for _ in SCENARIOS]

    def record(self, index: int, turn: int, began: float, ended: float) -> None:
        request = turn % len(SCENARIOS[index].requests())
        if self.warm_at is not None and began >= self.warm_at:
            self.after_warm[index].add(request)
        self.first[index].add(request)
        if self.warm_at is None and all(len(seen) == len(s.requests()) for seen, s in zip(self.first, SCENARIOS)):
            self.warm_at = ended

    def done(self, now: float) -> bool:
        if now - self.started > HARD_LIMIT_SECONDS:
            raise AssertionError(f"after {HARD_LIMIT_SECONDS} s the server had not served two rounds: first round "
                                 f"{[len(s) for s in self.first]}, after warm {[len(s) for s in self.after_warm]}")
        return (self.warm_at is not None and now - self.started >= LOAD_SECONDS
                and all(len(seen) == len(s.requests()) for seen, s in zip(self.after_warm, SCENARIOS)))


async def _user(browser, base: str, index: int, progress: Progress, log: list) -> None:
    """One context: requests its scenario's links in turn until ``progress`` is done, recording what each showed."""
    scenario = SCENARIOS[index]
    context = await browser.new_context(viewport={"width": 1300, "height": 1600})
    page = await context.new_page()
    page.set_default_timeout(600_000)
    try:
        turn = 0
        while not progress.done(time.monotonic()):
            prompt, extra = scenario.requests()[turn % len(scenario.requests())]
            started = time.monotonic()
            await page.goto(_url(base, scenario, prompt, extra))
            handle = await page.wait_for_function(READ_JS, arg=[scenario.read], timeout=600_000, polling=100)
            shown = await handle.json_value()
            ended = time.monotonic()
            log.append((index, prompt, tuple(sorted(extra.items())), shown, await _problems(page),
                        ended - started, ended))
            progress.record(index, turn, started, ended)
            turn += 1
            await asyncio.sleep(THINK_SECONDS)
    finally:
        await context.close()


async def _run(base: str, server_pid: int) -> tuple[list, list, dict, Progress]:
    from playwright.async_api import async_playwright

    log, memory = [], []
    process = psutil.Process(server_pid)
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=dashboard.CHROMIUM, headless=True,
                                                   args=["--headless", "--no-sandbox"])
        progress = Progress(time.monotonic())
        users = [asyncio.create_task(_user(browser, base, i, progress, log)) for i in range(len(SCENARIOS))]
        while not all(u.done() for u in users):
            memory.append((time.monotonic(), process.memory_info().rss))
            await asyncio.sleep(1.0)
        for user in users:
            user.result()  # re-raises a context's failure
        hooks = {}
        page = await browser.new_page()
        for name in sorted({s.model for s in SCENARIOS}):
            await page.goto(f"{base}/?model={name}")
            handle = await page.wait_for_function(READ_JS, arg=["Hooks attached now"], timeout=120_000)
            hooks[name] = await handle.json_value()
        await browser.close()
    return log, memory, hooks, progress


def test_six_users_for_two_minutes(tmp_path):
    reason = dashboard.browser_unavailable()
    if reason:
        pytest.skip(reason)
    expected = _expected_values()
    port = dashboard.free_port()
    with open(tmp_path / "server.log", "w") as server_log:
        server = dashboard.start_server(port, server_log)
        try:
            dashboard.wait_healthy(port, server)
            # In a thread of its own: another e2e file's sync Playwright may own this thread's event loop.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                log, memory, hooks, progress = pool.submit(asyncio.run,
                                                           _run(f"http://127.0.0.1:{port}", server.pid)).result()
        finally:
            dashboard.stop_server(server)

    problems = [(SCENARIOS[i].page, SCENARIOS[i].model, prompt, p) for i, prompt, _, _, p, _, _ in log if p]
    assert not problems, problems
    wrong = [(SCENARIOS[i].page, SCENARIOS[i].model, prompt, shown, expected[i, prompt, extra])
             for i, prompt, extra, shown, _, _, _ in log if shown != expected[i, prompt, extra]]
    assert not wrong, f"values that differ from the page's own computation alone: {wrong[:5]}"
    per_context = [sum(1 for entry in log if entry[0] == i) for i in range(len(SCENARIOS))]
    assert all(n >= 2 for n in per_context), f"a context was starved: requests per context {per_context}"
    assert all(value == "0" for value in hooks.values()), f"hooks left attached after the run: {hooks}"

    # Warm once every context had shown each of its requests once (every model loaded, every result cached);
    # from then on, through a second full round of every context, memory must stay flat.
    after = [rss for t, rss in memory if t >= progress.warm_at]
    peak = max(rss for _, rss in memory)
    growth = max(after) - after[0] if after else 0
    seconds = sorted(entry[5] for entry in log)
    elapsed = log[-1][6] - progress.started
    print(f"\nload test: {len(SCENARIOS)} contexts, {len(log)} requests served in {elapsed:.0f} s "
          f"(warm after {progress.warm_at - progress.started:.0f} s; per context {per_context}), median request "
          f"{seconds[len(seconds) // 2]:.2f} s, slowest {seconds[-1]:.2f} s, server peak RSS {peak / 2**20:.0f} MiB, "
          f"growth once warm {growth / 2**20:+.0f} MiB over {len(after)} samples, hooks attached afterwards {hooks}")
    assert after, "no memory sample after the server was warm"
    assert growth < MEMORY_GROWTH_LIMIT, f"server memory grew {growth / 2**20:.0f} MiB once warm"
