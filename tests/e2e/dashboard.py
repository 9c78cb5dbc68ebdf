"""Driving the real dashboard: start its server (`python -m app.serve`, i.e. `streamlit run app/Home.py`) on a free loopback port, open Debian's
Chromium through Playwright, and wait for Streamlit to finish a rerun.

Shared by the browser test (tests/e2e) and the dashboard benchmark (tests/benchmarks). No
browser is ever downloaded: Playwright drives /usr/bin/chromium.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO, Optional, Pattern, Union

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
# Streamlit shows its status widget while a script runs and marks elements stale until redrawn.
IDLE_JS = ("() => !document.querySelector('[data-testid=\"stStatusWidget\"]') "
           "&& !document.querySelector('[data-stale=\"true\"]')")


def browser_unavailable() -> Optional[str]:
    """Why a browser test cannot run here, or None when it can.

    Example:
        >>> browser_unavailable() in (None, "no /usr/bin/chromium (apt-get install chromium)",
        ...                            "the playwright package is not installed (pip install playwright)")
        True
    """
    if not Path(CHROMIUM).exists():
        return f"no {CHROMIUM} (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright)"
    return None


def free_port() -> int:
    """A TCP port nobody listens on at the moment (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, log: IO, env: Optional[dict] = None, explicit: bool = True) -> subprocess.Popen:
    """`python -m app.serve` (`streamlit run app/Home.py` with the default model loading from launch, as `make run`
    starts it) on 127.0.0.1:``port``, output to ``log``.

    ``explicit=False`` names only the port and the file watcher, so the repository's
    .streamlit/config.toml decides the rest (as in a user's `make run`).

    Example:
        >>> server = start_server(free_port(), open("server.log", "w"))   # doctest: +SKIP
    """
    settings = ["--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false"]
    command = [sys.executable, "-m", "app.serve", "--server.port", str(port),
               "--server.fileWatcherType", "none", *(settings if explicit else [])]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=full_env)


def wait_healthy(port: int, server: subprocess.Popen, timeout: float = 90.0) -> None:
    """Blocks until /_stcore/health answers "ok"; raises if the server exits or the time runs out."""
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/_stcore/health"
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"streamlit exited with code {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.read().strip() == b"ok":
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"streamlit was not healthy at {url} within {timeout:.0f} s")


def stop_server(server: subprocess.Popen) -> None:
    """Terminates the server (SIGTERM, then SIGKILL after 10 s)."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def launch_chromium(playwright):
    """Debian's Chromium, headless, through Playwright (never a downloaded browser)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--headless", "--no-sandbox"])


def wait_idle(page, timeout_ms: float = 60_000) -> None:
    """Waits until Streamlit is not running a script and nothing on the page is stale."""
    page.wait_for_function(IDLE_JS, timeout=timeout_ms)


class ScriptRuns:
    """Counts the script runs the server reports complete on ``page``'s websockets (a whole run or a fragment's;
    not one cut short for a rerun), so a timing can wait for the run its action started.

    The page's markers (the status widget, stale elements) can read idle in the moment after a rerun's first
    elements arrive and before the rest of the run is known to the browser: on the Heads page a prompt change read
    done in 0.1 s while its run went on for a second. The server's ``script_finished`` message cannot.

    Example:
        >>> runs = ScriptRuns(page)   # doctest: +SKIP
        >>> before = runs.done; page.keyboard.press("Control+Enter"); runs.wait_after(page, before)   # doctest: +SKIP
    """

    def __init__(self, page) -> None:
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        self._message, self._cut_short = ForwardMsg, ForwardMsg.FINISHED_EARLY_FOR_RERUN
        self.done, self._socket = 0, None
        page.on("websocket", self._on_socket)

    def _on_socket(self, socket) -> None:
        self._socket = socket  # a reload opens a new one; a page switch keeps it
        socket.on("framereceived", self._on_frame)

    def _on_frame(self, payload) -> None:
        if not isinstance(payload, (bytes, bytearray)):
            return
        message = self._message()
        message.ParseFromString(payload)
        if message.WhichOneof("type") == "script_finished" and message.script_finished != self._cut_short:
            self.done += 1

    def wait_after(self, page, before: int, timeout_ms: float = 60_000) -> None:
        """Waits until a run completes after ``before`` runs had (then the browser still draws: ``wait_idle``).

        It sleeps until the socket's next frame, each time (no polling: a timing loop would take the CPU the
        browser and the server are timed on)."""
        deadline = time.monotonic() + timeout_ms / 1000
        while self.done <= before:
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0 or self._socket is None:
                raise TimeoutError(f"no script run completed within {timeout_ms / 1000:.0f} s")
            self._socket.wait_for_event("framereceived", timeout=left_ms)


def wait_chart(page, key: str, title: Optional[str] = None, timeout_ms: float = 60_000) -> None:
    """Waits until the plotly chart drawn with ``key`` is rendered (and its title contains ``title``)."""
    js = ("([key, title]) => { const root = document.querySelector('.st-key-' + key + '_chart');"
          " if (!root || !root.querySelector('.main-svg')) return false;"
          " if (!title) return true;"
          " const t = root.querySelector('.gtitle'); return !!t && t.textContent.includes(title); }")
    try:
        page.wait_for_function(js, arg=[key, title or ""], timeout=timeout_ms)
    except Exception as error:  # a timeout says only "timeout": say what the page showed instead
        raise AssertionError(f"chart {key!r} not drawn within {timeout_ms / 1000:.0f} s; the page shows:\n"
                             f"{page_messages(page)}") from error


def page_messages(page) -> str:
    """The texts of the page's alerts (info, warning, error) and exceptions, one per line: what a person looking at
    a failed test's page would read first."""
    texts = page.locator('[data-testid="stAlert"], [data-testid="stException"]').all_inner_texts()
    busy = "" if page.evaluate(IDLE_JS) else "(a script is still running)\n"
    return busy + ("\n".join(text.strip()[:500] for text in texts) or "(no alert or exception)")


def click_points_until_heading_changes(page, chart_key: str, heading: Union[str, Pattern]) -> tuple[str, str]:
    """Clicks the plotly chart's markers one by one (as a user would) until the first heading named ``heading``
    reads otherwise: (its text before, its text after). A marker not drawn at that moment (plotly redrawing, or
    off the axes) is skipped, as no user could click it."""
    card = page.get_by_role("heading", name=heading).first
    before = now = card.inner_text()
    points = page.locator(f".st-key-{chart_key}_chart .scatterlayer .trace .points path")
    for index in range(points.count()):
        box = points.nth(index).bounding_box()
        if box is None:
            continue
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        _wait_for_rerun_to_start(page, card, before)
        wait_idle(page)
        now = card.inner_text()
        if now != before:
            break
    return before, now


def _wait_for_rerun_to_start(page, card, before: str, limit_s: float = 15.0) -> None:
    """Waits until a click's rerun has begun (Streamlit busy, or the card already changed), at most ``limit_s``: on a
    loaded machine the rerun can start seconds after the click, and a fixed pause then read the old card as final."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if card.inner_text() != before or not page.evaluate(IDLE_JS):
            return
        page.wait_for_timeout(100)


def open_page(page, name: str, heading: str, timeout_ms: float = 60_000) -> None:
    """Clicks ``name`` in the sidebar (keeping the session) and waits for the page's heading."""
    page.locator('[data-testid="stSidebarNav"] a', has_text=name).first.click()
    page.get_by_role("heading", name=heading).wait_for(timeout=timeout_ms)


def set_prompt(page, text: str, timeout_ms: float = 60_000) -> None:
    """Types ``text`` into the prompt box, applies it (Ctrl+Enter) and waits until the page has redrawn.

    The prompt box lists the prompt's tokens under it; a changed list means the rerun has begun.
    """
    tokens_js = "() => { const e = document.querySelector('.st-key-prompt_tokens'); return e ? e.textContent : ''; }"
    before = page.evaluate(tokens_js)
    box = page.locator(".st-key-prompt textarea")
    box.fill(text)
    box.press("Control+Enter")
    page.wait_for_function(f"(before) => ({tokens_js})() !== before", arg=before, timeout=timeout_ms)
    wait_idle(page, timeout_ms)
