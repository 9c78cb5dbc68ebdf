"""The browser test's fixtures: a real `streamlit run` server on a free loopback port and a
headless Debian Chromium driven by Playwright. Both are shared by every e2e file and shut down when the session ends.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.e2e import dashboard

SCREENSHOTS = dashboard.REPO / "test-output" / "screenshots"  # gitignored; kept for people to look at


@pytest.fixture(scope="session")  # one server for every e2e file: starting one and loading SmolLM2 costs ~10 s
def server_url(tmp_path_factory):
    reason = dashboard.browser_unavailable()
    if reason:
        pytest.skip(reason)
    log_path = tmp_path_factory.mktemp("streamlit") / "server.log"
    port = dashboard.free_port()
    with open(log_path, "w") as log:
        # The run's disk cache (tests/conftest.py), inherited: converted weights are read, not converted again, and
        # nothing is read from or left in the user's.
        server = dashboard.start_server(port, log)
        try:
            dashboard.wait_healthy(port, server)
        except Exception as error:
            dashboard.stop_server(server)
            pytest.fail(f"{error}\n--- server log ---\n{log_path.read_text()[-3000:]}")
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            dashboard.stop_server(server)


@pytest.fixture(scope="session")
def chromium():
    """The worker's one headless Chromium: Playwright's sync API runs one at a time in a process, so every e2e file
    (the shared server's, and those that start a server of their own) opens its pages here."""
    reason = dashboard.browser_unavailable()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = dashboard.launch_chromium(playwright)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="session")
def browser(server_url, chromium):
    """Chromium, with the shared server started."""
    return chromium


@pytest.fixture
def screenshot(tmp_path):
    """``screenshot(page, name)`` saves a PNG under the test's tmp_path and copies it to test-output/screenshots/."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def save(page, name: str) -> Path:
        path = tmp_path / f"{name}.png"
        page.screenshot(path=str(path))
        shutil.copy(path, SCREENSHOTS / path.name)
        return path

    return save
