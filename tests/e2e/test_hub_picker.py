"""Models from the Hub on the dashboard, in a real browser against a fake hub (tests/hub_server.py) on loopback: a
repo id typed on Home downloads on the click with its progress shown, then opens; a link naming a repo id offers it
and sends nothing to the Hub until the click.
"""

from __future__ import annotations

import pytest

from tests.e2e import dashboard
from tests.e2e.dashboard import wait_idle
from tests.hub_server import FakeHub
from tests.unit.hub_repos import hf_repo

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def fake_hub(tmp_path_factory):
    hub = FakeHub()
    hub.add("tiny-org/tiny-llama", hf_repo(tmp_path_factory.mktemp("llama"), "llama", seed=1).files())
    hub.add("tiny-org/tiny-gpt2", hf_repo(tmp_path_factory.mktemp("gpt2"), "gpt2", seed=2).files())
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def hub_dashboard(fake_hub, chromium, tmp_path_factory):
    """A dashboard of its own, online to the fake hub, with an empty HF cache; and the worker's Chromium."""
    home = tmp_path_factory.mktemp("hf-home")
    env = {"HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_HOME": str(home),
           "HF_HUB_CACHE": str(home / "hub"), "WORKBENCH_CACHE_DIR": str(tmp_path_factory.mktemp("workbench-cache"))}
    port = dashboard.free_port()
    log_path = home / "server.log"
    with open(log_path, "w") as log:
        server = dashboard.start_server(port, log, env=env)
        try:
            dashboard.wait_healthy(port, server)
            yield f"http://127.0.0.1:{port}", chromium
        finally:
            dashboard.stop_server(server)


def test_a_typed_repo_id_downloads_on_the_click_with_its_progress_then_opens(fake_hub, hub_dashboard):
    url, chromium = hub_dashboard
    size = len(fake_hub.repos["tiny-org/tiny-llama"].commits[fake_hub.repos["tiny-org/tiny-llama"].refs["main"]]
               ["model.safetensors"])
    stall = fake_hub.stall("model.safetensors", after_bytes=size // 2)  # the weights wait half-way: progress shows
    page = chromium.new_page(viewport={"width": 1400, "height": 1600})
    page.set_default_timeout(90_000)
    try:
        page.goto(f"{url}/?model=toy-attn-2l")
        page.get_by_role("heading", name="Open model: toy-attn-2l").wait_for()
        wait_idle(page)
        page.get_by_label("Hugging Face Hub repo id (org/name) or TransformerLens name").fill("tiny-org/tiny-llama")
        page.get_by_role("button", name="Download and open").click()
        page.locator('[data-testid="stProgress"]').wait_for()
        page.get_by_text("Downloading tiny-org/tiny-llama: ").first.wait_for()  # "… 3.2 KiB of 180.1 KiB"
        assert stall.reached.wait(timeout=60)
        stall.release.set()  # the transfer is cut there: huggingface_hub fetches the rest
        page.get_by_role("heading", name="Open model: tiny-org/tiny-llama").wait_for()
        wait_idle(page)
        assert page.get_by_text("Downloaded tiny-org/tiny-llama at commit").count() == 1
        assert page.locator('[data-testid="stException"]').count() == 0
    finally:
        stall.release.set()
        page.close()


def test_a_link_naming_a_repo_id_offers_it_and_asks_the_hub_nothing_until_the_click(fake_hub, hub_dashboard):
    url, chromium = hub_dashboard
    page = chromium.new_page(viewport={"width": 1400, "height": 1600})
    page.set_default_timeout(90_000)
    try:
        asked_before = len(fake_hub.requests)
        page.goto(f"{url}/?model=tiny-org/tiny-gpt2&impl=eager")
        page.get_by_text("This link names a Hugging Face Hub model").first.wait_for()
        wait_idle(page, 120_000)  # the default model opens meanwhile
        assert len(fake_hub.requests) == asked_before  # offered, not fetched
        page.get_by_role("button", name="Download and open the linked model").click()
        page.get_by_role("heading", name="Open model: tiny-org/tiny-gpt2").wait_for()
        wait_idle(page)
        fetched = [r.path for r in fake_hub.file_requests("GET")]
        assert any(path.startswith("/tiny-org/tiny-gpt2/resolve/") and path.endswith("/model.safetensors")
                   for path in fetched), fetched
    finally:
        page.close()
