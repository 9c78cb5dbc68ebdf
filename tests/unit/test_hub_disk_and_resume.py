"""Before and after a download from the (fake, loopback) Hub: an SAE's files are checked against the free disk as a
model's are, and a download killed mid-way in another process is resumed by the next load, never loaded half.

Expected values: transformers' own load of the same files (``tests/unit/hub_repos.py``); the request log of the
fake hub for what was fetched.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.hub_server import files_of, hub  # noqa: F401  (the fixture)
from tests.unit.hub_repos import hf_repo, tokens
from workbench.hub import HubDiskSpaceError, HubNotFoundError, sae_releases

ROOT = Path(__file__).resolve().parents[2]
SAE = ROOT / "tests" / "fixtures" / "sae" / "jumprelu"  # a SAELens-format folder written by SAELens 6.54.12
REPO = "tiny-org/tiny-saes"
Usage = namedtuple("usage", "total used free")


@pytest.fixture
def release(hub, monkeypatch):  # noqa: F811
    hub.add(REPO, {f"layer_0/{name}": data for name, data in files_of(SAE).items() if name != "expected.safetensors"})
    monkeypatch.setattr(sae_releases, "_RELEASES", {"tiny-release": {
        "repo_id": REPO, "model": "toy", "conversion": "sae_lens", "saes": [{"id": "l0", "path": "layer_0"}]}})
    return hub


def test_an_sae_that_does_not_fit_on_the_disk_is_refused_before_any_byte(release, monkeypatch):
    weights = (SAE / "sae_weights.safetensors").stat().st_size
    monkeypatch.setattr("workbench.hub.disk.disk_usage", lambda path: Usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(HubDiskSpaceError, match=rf"{REPO}: its files to download \(layer_0/cfg.json, "
                                                r"layer_0/sae_weights.safetensors\) take .*1000 B free; nothing was downloaded"):
        wb.load_sae("tiny-release", "l0")
    assert release.file_requests("GET") == []  # sized by HEAD requests only
    assert weights > 1000
    monkeypatch.setattr("workbench.hub.disk.disk_usage", lambda path: Usage(10**9, 0, 10**9))
    fetched = wb.load_sae("tiny-release", "l0")
    monkeypatch.setattr("workbench.hub.disk.disk_usage", lambda path: Usage(10**6, 10**6, 0))
    again = wb.load_sae("tiny-release", "l0")  # cached files cost nothing: no disk needed
    assert torch.equal(again.W_enc, fetched.W_enc) and torch.equal(fetched.W_enc, wb.load_sae(SAE).W_enc)


def test_fetch_files_keeps_its_signature_and_returns_the_cached_paths(release):
    paths = sae_releases.fetch_files(REPO, ["layer_0/cfg.json", "layer_0/sae_weights.safetensors"], revision="main")
    assert [path.read_bytes() for path in paths] == [(SAE / "cfg.json").read_bytes(),
                                                     (SAE / "sae_weights.safetensors").read_bytes()]


# huggingface_hub writes a download in 10 MB chunks; this test's file is far smaller, so the killed process writes
# 4 KiB ones, as a real multi-GB file's first chunks reach the disk before a kill.
LOAD = ("import sys, huggingface_hub.constants as c, workbench as wb; c.DOWNLOAD_CHUNK_SIZE = 4096; "
        "wb.load_model(sys.argv[1])")


def test_a_download_killed_mid_way_resumes_in_the_next_process(hub, tmp_path):
    """huggingface_hub 2.4 writes each file to a ``*.incomplete`` of its own process and never resumes another's;
    the next load continues the dead process's partial from its last byte (the fake hub's log shows a ``Range``
    request starting at the partial's size), and the half-written file is never loaded."""
    repo = hf_repo(tmp_path / "llama", "llama", seed=1)
    sha = hub.add("tiny-org/tiny-llama", repo.files())
    size = len(repo.files()["model.safetensors"])
    stall = hub.stall("model.safetensors", after_bytes=size // 2)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the fixture's HF_ENDPOINT and cache, online
    process = subprocess.Popen([sys.executable, "-c", LOAD, "tiny-org/tiny-llama"], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert stall.reached.wait(timeout=180), process.stderr.read().decode() if process.poll() is not None else ""
        time.sleep(0.5)  # the first half is on its way into the partial file
    finally:
        process.kill()
        process.wait()
    stall.release.set()
    blobs = hub.cache / "models--tiny-org--tiny-llama" / "blobs"
    partials = list(blobs.glob("*.incomplete"))
    assert partials, "the killed process left no partial file"
    partial_bytes = max(path.stat().st_size for path in partials)
    assert 0 < partial_bytes < size
    snapshot = hub.cache / "models--tiny-org--tiny-llama" / "snapshots" / sha
    assert (snapshot / "config.json").is_file() and not (snapshot / "model.safetensors").exists()
    with pytest.raises(HubNotFoundError, match=r"tiny-org/tiny-llama.*local_files_only=True.*missing: \['model.safetensors'\]"):
        wb.load_model("tiny-org/tiny-llama", local_files_only=True)  # the partial file is not a model

    model = wb.load_model("tiny-org/tiny-llama", attn_impl="eager")  # this process never saw the first download
    weight_reads = [r for r in hub.file_requests("GET") if r.path.endswith("/model.safetensors")]
    assert [r.range for r in weight_reads] == [None, f"bytes={partial_bytes}-"]  # resumed from its last byte
    assert not list(blobs.glob("*.incomplete"))  # the dead process's partial is gone
    ids = tokens(model.cfg.d_vocab)
    with torch.no_grad():
        assert (model(ids) - repo.reference(ids).logits).abs().max() < 1e-4
    assert model.hub_origin.commit == sha


def test_a_partial_whose_bytes_are_not_the_files_is_deleted_and_fetched_whole(hub, tmp_path):
    """A dead partial of the right file (its name carries the file's ETag) but with other bytes: continued, it fails
    the digest its ETag is, so it is deleted and the file fetched again from byte 0; never loaded."""
    repo = hf_repo(tmp_path / "llama", "llama", seed=2)
    hub.add("tiny-org/tiny-llama", repo.files())
    data = repo.files()["model.safetensors"]
    etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id, as the Hub's ETag
    blobs = hub.cache / "models--tiny-org--tiny-llama" / "blobs"
    blobs.mkdir(parents=True)
    half = len(data) // 2
    (blobs / f"{etag}.0badf00d.incomplete").write_bytes(bytes(b ^ 0xFF for b in data[:half]))  # not the file's bytes
    model = wb.load_model("tiny-org/tiny-llama", attn_impl="eager")
    weight_reads = [r.range for r in hub.file_requests("GET") if r.path.endswith("/model.safetensors")]
    assert weight_reads == [f"bytes={half}-", None]  # continued, refused by its digest, fetched whole
    assert not list(blobs.glob("*.incomplete"))
    ids = tokens(model.cfg.d_vocab)
    with torch.no_grad():
        assert (model(ids) - repo.reference(ids).logits).abs().max() < 1e-4


def test_an_sae_file_a_dead_process_left_half_written_resumes_from_its_last_byte(release):
    """An SAE's files come one by one (hf_hub_download), and a dead partial of one is continued as a model's are."""
    data = (SAE / "sae_weights.safetensors").read_bytes()
    etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id, as the Hub's ETag
    blobs = release.cache / f"models--{REPO.replace('/', '--')}" / "blobs"
    blobs.mkdir(parents=True)
    half = len(data) // 2
    (blobs / f"{etag}.deadbeef.incomplete").write_bytes(data[:half])
    sae = wb.load_sae("tiny-release", "l0")
    reads = [r.range for r in release.file_requests("GET") if r.path.endswith("/layer_0/sae_weights.safetensors")]
    assert reads == [f"bytes={half}-"]  # only the missing half was sent
    assert not list(blobs.glob("*.incomplete"))
    assert torch.equal(sae.W_enc, wb.load_sae(SAE).W_enc)
