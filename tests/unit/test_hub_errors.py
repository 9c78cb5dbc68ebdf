"""Before and around a download from the (fake, loopback) Hub: every failure names the repo and what to do,
and nothing half-fetched is ever loaded."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

import workbench as wb
from tests.hub_server import hub  # noqa: F401  (the fixture)
from tests.unit.hub_repos import hf_repo, tokens
from workbench.hub import HubAccessError, HubDiskSpaceError, HubNotFoundError
from workbench.loading import CheckpointNotFoundError


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return hf_repo(tmp_path_factory.mktemp("llama"), "llama", seed=1)


def test_offline_with_nothing_cached_names_the_repo_and_the_missing_files(hub, llama, monkeypatch):
    hub.add("tiny-org/tiny-llama", llama.files())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set after import: read when the call runs
    with pytest.raises(CheckpointNotFoundError, match=r"tiny-org/tiny-llama.*HF_HUB_OFFLINE=1.*missing: \['config.json'\]"):
        wb.load_model("tiny-org/tiny-llama")
    with pytest.raises(CheckpointNotFoundError, match=r"tiny-org/tiny-llama.*missing: \['config.json'\]"):
        wb.model_config("tiny-org/tiny-llama")
    assert hub.requests == []


def test_an_unreachable_hub_with_nothing_cached_names_the_repo(hub, llama):
    hub.stop()
    with pytest.raises(CheckpointNotFoundError, match=r"tiny-org/tiny-llama.*could not be reached.*missing: \['config.json'\]"):
        wb.load_model("tiny-org/tiny-llama")


def test_a_missing_repo_revision_or_file_is_named(hub, llama):
    hub.add("tiny-org/tiny-llama", llama.files())
    with pytest.raises(CheckpointNotFoundError, match=r"tiny-org/no-such-repo.*no model repo of that name \(HTTP 404\)"):
        wb.load_model("tiny-org/no-such-repo")
    with pytest.raises(HubNotFoundError, match=r"tiny-org/tiny-llama: no revision 'no-such-branch'"):
        wb.load_model("tiny-org/tiny-llama", revision="no-such-branch")
    with pytest.raises(HubNotFoundError, match=r"tiny-org/tiny-llama.*no file 'nope.gguf' in the repo"):
        wb.load_model("tiny-org/tiny-llama", gguf_file="nope.gguf")


def test_a_gated_repo_says_to_accept_the_licence_and_set_hf_token(hub, llama, monkeypatch):
    hub.add("tiny-org/gated", llama.files(), gated_token="hf_secret")
    with pytest.raises(HubAccessError, match=r"tiny-org/gated.*gated.*accept its licence at .*/tiny-org/gated.*HF_TOKEN"):
        wb.load_model("tiny-org/gated")
    with pytest.raises(HubAccessError, match=r"tiny-org/gated.*gated.*licence.*HF_TOKEN"):  # a token, not one it takes
        wb.load_model("tiny-org/gated", token="hf_wrong")
    assert not hub.full_weight_reads()
    assert wb.load_model("tiny-org/gated", token="hf_secret").cfg.n_layers == 2
    monkeypatch.setenv("HF_TOKEN", "hf_secret")  # read when the call runs
    assert wb.load_model("tiny-org/gated", revision=hub.repos["tiny-org/gated"].refs["main"]).cfg.n_layers == 2


def test_a_download_that_does_not_fit_is_refused_before_any_byte(hub, llama, monkeypatch):
    hub.add("tiny-org/tiny-llama", llama.files())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("workbench.hub.disk.disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(HubDiskSpaceError, match=r"tiny-org/tiny-llama: .*model.safetensors.*1000 B free; nothing was downloaded"):
        wb.load_model("tiny-org/tiny-llama")
    assert hub.file_requests("GET") == [] and hub.file_requests("HEAD") == []


def test_a_half_written_download_is_never_loaded(hub, llama, monkeypatch):
    """An interrupted transfer leaves a ``*.incomplete`` blob and no snapshot entry: offline the file is
    missing (named), online it is fetched again whole."""
    sha = hub.add("tiny-org/tiny-llama", llama.files())
    wb.load_model("tiny-org/tiny-llama")
    snapshot = hub.cache / "models--tiny-org--tiny-llama" / "snapshots" / sha
    blob = (snapshot / "model.safetensors").resolve()
    partial = blob.with_name(blob.name + ".0123abcd.incomplete")
    partial.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])
    (snapshot / "model.safetensors").unlink()
    blob.unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubNotFoundError, match=r"tiny-org/tiny-llama.*HF_HUB_OFFLINE=1.*missing: \['model.safetensors'\]"):
        wb.load_model("tiny-org/tiny-llama")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    model = wb.load_model("tiny-org/tiny-llama", attn_impl="eager")
    ids = tokens(model.cfg.d_vocab)
    with torch.no_grad():
        assert (model(ids) - llama.reference(ids).logits).abs().max() < 1e-4
