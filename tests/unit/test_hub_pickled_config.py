"""``model_config`` and ``plan_memory`` of a Hub repo whose only weights are a pickle (``pytorch_model.bin``): a pickle
has no header to read tensor names and dtypes from by range requests, so before its weights are cached both say
so (naming the repo, the file and what to do) and fetch nothing; once cached, both read the names and dtypes of
the memory-mapped file, writing no copy of the weights, and say what the load gives.
"""

from __future__ import annotations

import pandas as pd
import pytest

import workbench as wb
from tests.hub_server import hub  # noqa: F401  (the fixture)
from tests.unit.hub_repos import hf_repo
from workbench.hub import HubError, HubNotFoundError

REPO = "tiny-org/pickled"
WHY = r"tiny-org/pickled.*pickles \(pytorch_model.bin\), which have no header.*load_model\(\) it once"


@pytest.fixture(scope="module")
def pickled(tmp_path_factory):
    return hf_repo(tmp_path_factory.mktemp("pickled"), "gpt2", seed=3, pickled=True)


@pytest.fixture(scope="module")
def same_as_safetensors(tmp_path_factory):
    """The same model (same seed) as transformers saves it in safetensors: what the plans must equal."""
    return hf_repo(tmp_path_factory.mktemp("safetensors"), "gpt2", seed=3)


def test_before_its_weights_are_cached_both_say_why_and_fetch_nothing(hub, pickled):
    hub.add(REPO, pickled.files())
    with pytest.raises(HubError, match=WHY):
        wb.model_config(REPO)
    with pytest.raises(HubError, match=WHY + r".*plan_memory\(\)"):
        wb.plan_memory(REPO, pos=8)
    assert hub.file_requests("GET") == [] and hub.file_requests("HEAD") == []


def test_offline_with_only_its_config_cached_names_the_missing_pickle(hub, pickled, monkeypatch):
    from huggingface_hub import hf_hub_download

    from workbench.hub.settings import online_switch

    hub.add(REPO, pickled.files())
    with online_switch():
        hf_hub_download(REPO, "config.json", cache_dir=hub.cache, endpoint=hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Offline nothing lists the repo's files: the error names both weights a load could read.
    with pytest.raises(HubNotFoundError, match=r"tiny-org/pickled.*HF_HUB_OFFLINE=1.*holds commit .* without them "
                                               r"\(missing: \['model.safetensors \(or its shards\) or pytorch_model.bin'\]"):
        wb.plan_memory(REPO, pos=8)


def test_once_cached_both_read_names_and_dtypes_and_copy_no_weights(hub, pickled, same_as_safetensors, monkeypatch):
    hub.add(REPO, pickled.files())
    model = wb.load_model(REPO)

    def no_copy(*args, **kwargs):
        raise AssertionError("the pickled weights were written out again")

    monkeypatch.setattr("workbench.hub.pickled.save_file", no_copy)
    asked = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # from the cache alone
    assert wb.model_config(REPO) == model.cfg.config
    plan = wb.plan_memory(REPO, device_map="sequential", max_memory={"cpu": "1GiB"}, pos=8)
    expected = wb.plan_memory(same_as_safetensors.directory, device_map="sequential", max_memory={"cpu": "1GiB"}, pos=8)
    pd.testing.assert_frame_equal(plan, expected)
    assert len(hub.requests) == asked
