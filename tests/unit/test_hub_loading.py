"""Models from a (fake, loopback) Hub by repo id: what transformers reads from the same files, fetched once.

The fake hub (tests/hub_server.py) answers the calls huggingface_hub 2.4 makes; checkpoints are tiny
models written by transformers itself (one single-file, one sharded, one pickle-only, one with remote
code, one GGUF). Expected logits: transformers' own load of the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.hub_server import hub  # noqa: F401  (the fixture)
from tests.unit.hub_repos import EVIL_CODE, NEVER_FETCHED, gguf_repo, hf_repo, tokens
from workbench.loading.registry import REGISTRY, RegisteredModel

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    made = {}
    junk = {"README.md": "# tiny", "flax_model.msgpack": "not read", "consolidated.safetensors": "not read either"}
    made["llama"] = hf_repo(tmp_path_factory.mktemp("llama"), "llama", seed=1, extras=junk)
    made["sharded"] = hf_repo(tmp_path_factory.mktemp("sharded"), "gpt2", seed=2, shard="60KB")
    made["pickled"] = hf_repo(tmp_path_factory.mktemp("pickled"), "gpt2", seed=3, pickled=True)
    made["gguf"] = gguf_repo(tmp_path_factory.mktemp("gguf"))
    return made


def assert_matches(model, reference) -> None:
    ids = tokens(model.cfg.d_vocab)
    with torch.no_grad():
        difference = (model(ids) - reference(ids).logits).abs().max().item()
    assert difference < TOLERANCE, difference


def test_a_repo_id_loads_what_transformers_reads_and_records_its_commit(hub, repos):
    sha = hub.add("tiny-org/tiny-llama", repos["llama"].files())
    model = wb.load_model("tiny-org/tiny-llama", attn_impl="eager")
    assert_matches(model, repos["llama"].reference)
    assert model.hub_origin.commit == sha and model.hub_origin.repo_id == "tiny-org/tiny-llama"
    assert model.hub_origin.revision == "main" and model.hub_origin.endpoint == hub.url
    assert model.cfg.model_name == "tiny-org/tiny-llama"
    fetched = {request.path.rsplit("/", 1)[-1] for request in hub.file_requests("GET")}
    assert "model.safetensors" in fetched and "config.json" in fetched
    assert not fetched & set(NEVER_FETCHED), fetched
    snapshot = hub.cache / "models--tiny-org--tiny-llama" / "snapshots" / sha
    assert (snapshot / "model.safetensors").is_file()  # the standard HF cache layout
    assert wb.load_model(Path(snapshot)).cfg.n_layers == 2


def test_a_sharded_checkpoint_loads_every_shard_its_index_names(hub, repos):
    files = repos["sharded"].files()
    shards = [name for name in files if name.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    hub.add("tiny-org/tiny-gpt2-sharded", files)
    assert_matches(wb.load_model("tiny-org/tiny-gpt2-sharded", attn_impl="eager"), repos["sharded"].reference)
    fetched = {request.path.rsplit("/", 1)[-1] for request in hub.full_weight_reads()}
    assert fetched == set(shards)


def test_a_pickle_only_repo_loads_through_weights_only_torch_load(hub, repos, monkeypatch):
    files = repos["pickled"].files()
    assert "pytorch_model.bin" in files and not any(name.endswith(".safetensors") for name in files)
    hub.add("tiny-org/tiny-gpt2-pickled", files)
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    model = wb.load_model("tiny-org/tiny-gpt2-pickled", attn_impl="eager")
    assert calls and all(weights_only is True for weights_only in calls)
    assert_matches(model, repos["pickled"].reference)


def test_a_gguf_file_of_a_repo_loads_as_transformers_reads_it(hub, repos):
    repo = repos["gguf"]
    sha = hub.add("tiny-org/tiny-gguf", repo.files())
    model = wb.load_model("tiny-org/tiny-gguf", gguf_file=repo.gguf_file, attn_impl="eager")
    assert_matches(model, repo.reference)
    assert model.hub_origin.commit == sha and model.hub_origin.files == (repo.gguf_file,)
    assert {request.path.rsplit("/", 1)[-1] for request in hub.file_requests("GET")} == {repo.gguf_file}


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "EvilForCausalLM"])
def test_remote_code_is_never_fetched_or_run(hub, repos, tmp_path, architecture):
    marker = tmp_path / "remote-code-ran"
    files = dict(repos["llama"].files())
    config = json.loads(files["config.json"])
    config.update(architectures=[architecture], auto_map={"AutoConfig": "modeling_evil.EvilConfig",
                                                          "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    files.update({"config.json": json.dumps(config).encode(),
                  "modeling_evil.py": EVIL_CODE.format(marker=str(marker)).encode()})
    hub.add("tiny-org/remote-code", files)
    if architecture == "LlamaForCausalLM":  # auto_map ignored: the architecture we know is loaded
        assert_matches(wb.load_model("tiny-org/remote-code", attn_impl="eager"), repos["llama"].reference)
    else:  # only remote code could build it: the usual unknown-architecture error
        with pytest.raises(wb.CheckpointError, match="unknown architecture.*EvilForCausalLM"):
            wb.load_model("tiny-org/remote-code")
    assert not marker.exists()
    assert not any(request.path.endswith("modeling_evil.py") for request in hub.requests)


def test_a_second_load_needs_no_hub(hub, repos, monkeypatch):
    hub.add("tiny-org/tiny-llama", repos["llama"].files())
    first = wb.load_model("tiny-org/tiny-llama", attn_impl="eager")
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = wb.load_model("tiny-org/tiny-llama", attn_impl="eager")
    assert_matches(offline, repos["llama"].reference)
    assert offline.hub_origin.commit == first.hub_origin.commit
    monkeypatch.delenv("HF_HUB_OFFLINE")  # online but the hub is gone: the cache serves, as offline
    assert wb.load_model("tiny-org/tiny-llama", attn_impl="eager").hub_origin.commit == first.hub_origin.commit
    assert wb.load_model("tiny-org/tiny-llama", local_files_only=True).cfg.n_layers == 2


def test_a_model_fetched_file_by_file_as_transformers_does_loads_offline(hub, repos, monkeypatch):
    from huggingface_hub import hf_hub_download

    from workbench.hub.settings import online_switch

    sha = hub.add("tiny-org/tiny-llama", repos["llama"].files())
    with online_switch():  # huggingface_hub was imported offline (tests/conftest.py); this process is online now
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            hf_hub_download("tiny-org/tiny-llama", name, cache_dir=hub.cache, endpoint=hub.url)
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = wb.load_model("tiny-org/tiny-llama", attn_impl="eager")
    assert_matches(model, repos["llama"].reference)
    assert model.hub_origin.commit == sha


def test_a_revision_loads_that_commit(hub, repos):
    old = hub.add("tiny-org/moving", repos["sharded"].files(), ref="v1")
    new = hub.add("tiny-org/moving", repos["llama"].files(), ref="main")
    tagged = wb.load_model("tiny-org/moving", revision="v1", attn_impl="eager")
    assert tagged.hub_origin.commit == old and tagged.hub_origin.revision == "v1"
    assert_matches(tagged, repos["sharded"].reference)
    assert wb.load_model("tiny-org/moving").hub_origin.commit == new
    assert wb.load_model("tiny-org/moving", revision=old).hub_origin.commit == old


def test_transformer_lens_names_resolve_to_their_repo_and_registered_names_win(hub, repos, monkeypatch, tmp_path):
    hub.add("gpt2", repos["sharded"].files())  # TransformerLens: "gpt2-small" is the repo "gpt2"
    model = wb.load_model("gpt2-small", attn_impl="eager")
    assert model.hub_origin.repo_id == "gpt2"
    assert_matches(model, repos["sharded"].reference)
    requests_before = len(hub.requests)
    monkeypatch.setitem(REGISTRY, "gpt2-small", RegisteredModel("gpt2-small", "ours",
                                                                lambda: repos["sharded"].directory, "n/a"))
    ours = wb.load_model("gpt2-small", attn_impl="eager")
    assert ours.hub_origin is None and ours.cfg.model_name == repos["sharded"].directory.name
    assert len(hub.requests) == requests_before  # the Hub was not asked


def test_the_endpoint_is_read_when_a_call_runs(hub, repos, monkeypatch):
    from tests.hub_server import FakeHub

    other = FakeHub()
    try:
        other.add("tiny-org/elsewhere", repos["llama"].files())
        monkeypatch.setenv("HF_ENDPOINT", other.url)
        assert wb.load_model("tiny-org/elsewhere").hub_origin.endpoint == other.url
        assert other.requests and not hub.requests
    finally:
        other.stop()
