"""Expected logits for models from the Hub by transformers reading the same (fake, loopback) Hub in this process: a
sharded safetensors repo, a pickle-only repo and a GGUF repo, each downloaded by ``transformers`` into a cache of
its own and by the workbench into another; logits within 1e-4.

huggingface_hub reads ``HF_ENDPOINT`` once, at import (the suite imports it offline, tests/conftest.py): for
transformers, which passes no endpoint, the fixture sets the library's own endpoint constants to the fake hub's
address and its offline flag off, as ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE=0`` at import would have.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from tests.hub_server import hub  # noqa: F401  (the fixture)
from tests.unit.hub_repos import gguf_repo, hf_repo, tokens

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    return {"tiny-org/sharded": hf_repo(tmp_path_factory.mktemp("sharded"), "gpt2", seed=2, shard="60KB"),
            "tiny-org/pickled": hf_repo(tmp_path_factory.mktemp("pickled"), "llama", seed=3, pickled=True),
            "tiny-org/gguf": gguf_repo(tmp_path_factory.mktemp("gguf"))}


@pytest.fixture
def transformers_online(hub, monkeypatch):  # noqa: F811
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return hub


@pytest.mark.parametrize("repo_id", ["tiny-org/sharded", "tiny-org/pickled", "tiny-org/gguf"])
def test_our_logits_match_transformers_reading_the_same_hub(transformers_online, repos, repo_id, tmp_path):
    from transformers import AutoModelForCausalLM

    hub, repo = transformers_online, repos[repo_id]
    hub.add(repo_id, repo.files())
    options = {"gguf_file": repo.gguf_file} if repo.gguf_file else {}
    reference = AutoModelForCausalLM.from_pretrained(repo_id, cache_dir=tmp_path / "transformers-cache",
                                                     dtype=torch.float32, **options).eval()
    read_by_transformers = {r.path.rsplit("/", 1)[-1] for r in hub.full_weight_reads()}
    assert read_by_transformers and all(f"/{repo_id}/resolve/" in r.path for r in hub.full_weight_reads())
    hub.requests.clear()
    model = wb.load_model(repo_id, attn_impl="eager", **options)  # our own download, into the fixture's HF cache
    assert {r.path.rsplit("/", 1)[-1] for r in hub.full_weight_reads()} == read_by_transformers
    ids = tokens(model.cfg.d_vocab)
    with torch.no_grad():
        difference = (model(ids) - reference(ids).logits).abs().max().item()
    assert difference < TOLERANCE, difference
