"""``model_config`` and ``plan_memory`` of a Hub repo read config.json and the safetensors headers (range
requests through huggingface_hub), never a whole weights file; what they say is what the load gives."""

from __future__ import annotations

import pandas as pd
import pytest

import workbench as wb
from tests.hub_server import hub  # noqa: F401  (the fixture)
from tests.unit.hub_repos import hf_repo
from workbench.hub import HubError


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    return {"llama": hf_repo(tmp_path_factory.mktemp("llama"), "llama", seed=1),
            "sharded": hf_repo(tmp_path_factory.mktemp("sharded"), "gpt2", seed=2, shard="60KB"),
            "pickled": hf_repo(tmp_path_factory.mktemp("pickled"), "gpt2", seed=3, pickled=True)}


@pytest.mark.parametrize("name", ["llama", "sharded"])
def test_model_config_and_plan_memory_read_no_weights(hub, repos, name):
    repo_id = f"tiny-org/{name}"
    sha = hub.add(repo_id, repos[name].files())
    cfg = wb.model_config(repo_id)
    plan = wb.plan_memory(repo_id, device_map="sequential", max_memory={"cpu": "1GiB"}, pos=8)
    assert hub.full_weight_reads() == []
    assert any(request.range for request in hub.file_requests("GET"))  # the headers, by range requests
    assert not (hub.cache / f"models--tiny-org--{name}" / "snapshots" / sha / "model.safetensors").exists()
    local_plan = wb.plan_memory(repos[name].directory, device_map="sequential", max_memory={"cpu": "1GiB"}, pos=8)
    pd.testing.assert_frame_equal(plan, local_plan)
    model = wb.load_model(repo_id)
    assert cfg == model.cfg.config and cfg.model_name == repo_id
    assert wb.model_config(repo_id, revision=sha) == cfg  # now from the cache


def test_a_pickle_only_repo_has_no_header_to_read_until_loaded(hub, repos):
    hub.add("tiny-org/pickled", repos["pickled"].files())
    with pytest.raises(HubError, match=r"tiny-org/pickled.*pickles \(pytorch_model.bin\).*load_model\(\) it once"):
        wb.model_config("tiny-org/pickled")
    assert hub.full_weight_reads() == []
    model = wb.load_model("tiny-org/pickled")
    assert wb.model_config("tiny-org/pickled") == model.cfg.config
