"""The dashboard's Hub picker (``app.hub_picker``) against the fake hub (tests/hub_server.py), under Streamlit's
AppTest: a typed repo id is downloaded only on the click, a link's repo id only offered, every failure of the Hub
shown as ``workbench.hub``'s message (never a traceback), and the HF cache's models listed and opened offline.
"""

from __future__ import annotations

from collections import namedtuple

import pytest
from streamlit.testing.v1 import AppTest

import workbench as wb
from app.hub_picker import cached_models
from tests.hub_server import hub  # noqa: F401  (the fixture)
from tests.unit.hub_repos import hf_repo
from tests.unit.test_app_link_safety import open_link, toy_default  # noqa: F401
from tests.unit.test_app_pages import APP
from workbench.hub import download_model
from workbench.memory import readable_bytes

REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return hf_repo(tmp_path_factory.mktemp("llama"), "llama", seed=1)


def home(**params: str) -> AppTest:
    return open_link("home", model="toy-attn-2l", **params)


def download_clicked(at: AppTest, source: str) -> AppTest:
    at.text_input(key="hub_repo_id").input(source)
    return next(button for button in at.button if button.label == "Download and open").click().run()


def test_download_model_reports_the_bytes_until_every_one_has_arrived(hub, llama):
    hub.add(REPO, llama.files())
    reports = []
    fetched = download_model(REPO, on_progress=lambda done, total: reports.append((done, total)))
    expected = sum(len(data) for name, data in llama.files().items() if name in fetched.origin.files)
    assert reports[-1] == (expected, expected)
    assert [done for done, _ in reports] == sorted(done for done, _ in reports)
    assert (fetched.path / "model.safetensors").is_file()


def test_the_cache_lists_its_model_repos_with_size_and_revisions(hub, llama):
    sha = hub.add(REPO, llama.files())
    fetched = download_model(REPO)
    dataset = hub.cache / "datasets--tiny-org--corpus"  # a dataset repo in the same cache is not a model
    for folder in ("blobs", "refs", f"snapshots/{'0' * 40}"):
        (dataset / folder).mkdir(parents=True)
    (dataset / "blobs" / "1234").write_text("rows")
    (dataset / "snapshots" / ("0" * 40) / "data.txt").symlink_to(dataset / "blobs" / "1234")
    (dataset / "refs" / "main").write_text("0" * 40)
    table = cached_models(hub.cache)
    assert table.repo_id.tolist() == [REPO]
    row = table.iloc[0]
    size = sum(len(data) for name, data in llama.files().items() if name in fetched.origin.files)
    assert (row["size"], row["revisions"], row["files"]) == (readable_bytes(size), f"main → {sha[:12]}",
                                                             len(fetched.origin.files))


def test_a_typed_repo_id_is_downloaded_on_the_click_and_opened(hub, llama, toy_default):  # noqa: F811
    hub.add(REPO, llama.files())
    at = home()
    assert hub.requests == []
    at = download_clicked(at, REPO)
    assert not at.exception and at.session_state["model_source"] == REPO
    assert any(f"Downloaded `{REPO}` at commit" in s.value for s in at.success)
    assert any(f"Open model: `{REPO}`" in h.value for h in at.subheader)


Usage = namedtuple("usage", "total used free")


@pytest.mark.parametrize("case, source, message", [
    ("missing", "tiny-org/no-such-repo", "no model repo of that name (HTTP 404)"),
    ("gated", "tiny-org/gated", "is gated and no token is set: accept its licence at"),
    ("offline", REPO, "the Hub is switched off (HF_HUB_OFFLINE=1)"),
    ("disk", REPO, "1000 B free; nothing was downloaded"),
    ("not a repo id", "/no such/path", "is not a Hub repo id"),
])
def test_a_failed_download_is_shown_as_the_hubs_message(hub, llama, toy_default, monkeypatch,  # noqa: F811
                                                         case, source, message):
    hub.add(REPO, llama.files())
    hub.add("tiny-org/gated", llama.files(), gated_token="hf_secret")
    if case == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if case == "disk":
        monkeypatch.setattr("workbench.hub.disk.disk_usage", lambda path: Usage(10**6, 10**6 - 1000, 1000))
    at = download_clicked(home(), source)
    assert not at.exception
    assert any(message in error.value for error in at.error), [error.value for error in at.error]
    assert at.session_state["model_source"] == "toy-attn-2l"
    assert hub.full_weight_reads() == []


def test_a_repo_id_in_a_link_is_offered_and_fetched_only_on_the_click(hub, llama, toy_default):  # noqa: F811
    hub.add(REPO, llama.files())
    at = open_link("home", model=REPO, impl="eager")
    assert any("This link names a Hugging Face Hub model" in info.value for info in at.info)
    at.run()
    assert hub.requests == [] and at.session_state["model_source"] == "toy-attn-2l"
    at.button(key="open_linked_hub_model").click().run()
    assert not at.exception and at.session_state["model_source"] == REPO and at.session_state["attn_impl"] == "eager"
    assert [r.path.rsplit("/", 1)[-1] for r in hub.full_weight_reads()] == ["model.safetensors"]
    assert "open_linked_hub_model" not in [button.key for button in at.button]


def test_a_cached_model_opens_with_the_hub_switched_off(hub, llama, toy_default, monkeypatch):  # noqa: F811
    hub.add(REPO, llama.files())
    download_model(REPO)
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    at = AppTest.from_file(str(APP / "Home.py"), default_timeout=90)
    at.query_params["model"] = "toy-attn-2l"
    at.run()
    at.selectbox(key="hub_cached_choice").select(REPO)
    at.button(key="hub_open_cached").click().run()
    assert not at.exception and at.session_state["model_source"] == REPO
    assert any(f"Open model: `{REPO}`" in h.value for h in at.subheader)
