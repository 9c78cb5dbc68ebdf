"""Transcoder sets from a (fake, loopback) Hub: circuit-tracer 0.5's presets, a repo reference holding its
``config.yaml``, and ``hf://`` entries of a local ``config.yaml``; only what the config names is fetched.

Expected values: circuit-tracer 0.5.0's own ``load_transcoder_from_hub`` reading the same fake Hub
(``tests/fixtures/tc_hub/make_fixtures.py``, repos built by ``tests/fixtures/tc_hub/repos.py`` from the committed
circuit-tracer fixtures): its ``encode`` and ``decode`` of an input, and its ``scan``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from tests.fixtures.tc_hub import repos
from tests.hub_server import hub  # noqa: F401  (the fixture)
from workbench.errors import CheckpointError, ConfigError
from workbench.hub.errors import HubAccessError, HubDiskSpaceError, HubNotFoundError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EXPECTED = load_file(str(FIXTURES / "tc_hub" / "expected.safetensors"))
META = json.loads((FIXTURES / "tc_hub" / "expected.json").read_text())


@pytest.fixture
def tc_hub(hub):  # noqa: F811
    for repo_id, files in repos.fake_repos().items():
        hub.add(repo_id, files)
    return hub


def assert_matches_circuit_tracer(tc: wb.TranscoderSet, name: str) -> None:
    x = EXPECTED[f"{name}.x"]
    with torch.no_grad():
        acts = [tc.encode(layer, x[layer]) for layer in range(tc.n_layers)]
        torch.testing.assert_close(torch.stack(acts), EXPECTED[f"{name}.encode"], atol=1e-5, rtol=0)
        torch.testing.assert_close(tc.reconstruct(acts, x), EXPECTED[f"{name}.decode"], atol=1e-5, rtol=0)
    assert tc.scan == META["scan"][name]


def test_the_llama_preset_loads_as_circuit_tracer_loads_it_fetching_only_what_its_config_names(tc_hub):
    tc = wb.load_transcoders("llama")
    assert tc.n_layers == 3 and tc.skip_connection
    assert (tc.feature_input_hook, tc.feature_output_hook) == ("hook_resid_mid", "hook_mlp_out")
    assert_matches_circuit_tracer(tc, "llama")
    assert tc_hub.fetched(repos.LLAMA) == {"config.yaml", "layer_0.safetensors", "layer_1.safetensors",
                                            "layer_2.safetensors"}


def test_the_gemma_preset_reads_gemma_scope_npz_files_from_the_repo_its_config_names(tc_hub):
    tc = wb.load_transcoders("gemma")
    assert all(threshold is not None for threshold in tc.threshold)
    assert_matches_circuit_tracer(tc, "gemma")
    assert tc_hub.fetched(repos.GEMMA) == {"config.yaml"}
    assert tc_hub.fetched(repos.GEMMA_WEIGHTS) == {f"{folder}/params.npz" for folder in repos.GEMMA_FOLDERS}


def test_a_repo_folder_without_a_transcoders_list_counts_its_layer_files(tc_hub, monkeypatch):
    tc = wb.load_transcoders("fake-org/tc-sets/plt")
    assert_matches_circuit_tracer(tc, "plt_listed")
    assert tc_hub.fetched(repos.SETS) == {"plt/config.yaml"} | {f"plt/layer_{i}.safetensors" for i in range(3)}
    as_address = wb.load_transcoders("hf://fake-org/tc-sets/plt?revision=main")  # circuit-tracer's hf:// spelling
    assert all(torch.equal(a, b) for a, b in zip(tc.state_dict().values(), as_address.state_dict().values()))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cached snapshot's own files are counted
    assert wb.load_transcoders("fake-org/tc-sets/plt").n_layers == 3


def test_a_cross_layer_transcoder_at_a_revision_fetches_its_encoder_and_decoder_files_only(tc_hub, monkeypatch):
    tc = wb.load_transcoders("fake-org/tc-sets/clt@main")
    assert tc.cross_layer
    assert_matches_circuit_tracer(tc, "clt")
    assert tc_hub.fetched(repos.SETS) == {"clt/config.yaml"} | {f"clt/{kind}_{i}.safetensors" for i in range(3)
                                                                 for kind in ("W_enc", "W_dec")}
    with pytest.raises(HubNotFoundError, match="fake-org/tc-sets: no revision 'v9'"):
        wb.load_transcoders("fake-org/tc-sets/clt@v9")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = wb.load_transcoders("fake-org/tc-sets/clt@main")
    assert all(torch.equal(a, b) for a, b in zip(tc.state_dict().values(), offline.state_dict().values()))


def _local_config(folder: Path, entries: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["model_kind: transcoder_set", "feature_input_hook: hook_resid_mid", "feature_output_hook: hook_mlp_out",
             "scan: fixtures/plt_skip", "transcoders:"] + [f"- {entry}" for entry in entries]
    (folder / "config.yaml").write_text("\n".join(lines) + "\n")
    return folder / "config.yaml"


def test_hf_entries_of_a_local_config_are_fetched_beside_its_local_files(tc_hub, tmp_path):
    shutil.copy(FIXTURES / "attribution" / "plt_skip" / "layer_0.safetensors", tmp_path / "layer_0.safetensors")
    config = _local_config(tmp_path, ["layer_0.safetensors"] +
                           [f"hf://{repos.LLAMA}/layer_{i}.safetensors?revision=main" for i in (1, 2)])
    tc = wb.load_transcoders(config)
    x = EXPECTED["llama.x"]
    with torch.no_grad():
        acts = [tc.encode(layer, x[layer]) for layer in range(3)]
        torch.testing.assert_close(torch.stack(acts), EXPECTED["llama.encode"], atol=1e-5, rtol=0)
        torch.testing.assert_close(tc.reconstruct(acts, x), EXPECTED["llama.decode"], atol=1e-5, rtol=0)
    assert tc.scan == "fixtures/plt_skip"  # a local config keeps its own scan
    assert tc_hub.fetched(repos.LLAMA) == {"layer_1.safetensors", "layer_2.safetensors"}


@pytest.mark.parametrize("entry", [f"hf://{repos.LLAMA}/../../secrets/layer_0.safetensors",
                                   f"hf://{repos.LLAMA}//etc/layer_0.safetensors",
                                   f"hf://{repos.LLAMA}/sub/./layer_0.safetensors",
                                   "hf://no-org/layer_0.safetensors"])
def test_an_hf_entry_leaving_its_repo_is_refused_before_anything_is_asked(tc_hub, tmp_path, entry):
    with pytest.raises(ConfigError, match=r"config.yaml: 'hf://"):
        wb.load_transcoders(_local_config(tmp_path, [entry]))
    assert tc_hub.requests == []


def test_an_entry_of_a_hub_config_leaving_its_repo_is_refused(tc_hub):
    tc_hub.add("fake-org/escape", {"config.yaml": b"model_kind: transcoder_set\nfeature_input_hook: mlp.hook_in\n"
                                                  b"feature_output_hook: mlp.hook_out\n"
                                                  b"transcoders:\n- ../x.safetensors\n"})
    with pytest.raises(ConfigError, match=r"fake-org/escape/config.yaml: field 'transcoders'\[0\].*'\.\.' step"):
        wb.load_transcoders("fake-org/escape")
    assert tc_hub.fetched("fake-org/escape") == {"config.yaml"}


def test_a_config_naming_a_file_the_repo_lacks_names_it(tc_hub, tmp_path):
    tc_hub.add("fake-org/broken", {"config.yaml": b"model_kind: transcoder_set\nfeature_input_hook: mlp.hook_in\n"
                                                  b"feature_output_hook: mlp.hook_out\ntranscoders:\n"
                                                  b"- layer_0.safetensors\n- layer_9.safetensors\n",
                                   "layer_0.safetensors": (FIXTURES / "attribution" / "plt" /
                                                           "layer_0.safetensors").read_bytes()})
    with pytest.raises(HubNotFoundError, match=r"fake-org/broken .*no file 'layer_9.safetensors' in the repo"):
        wb.load_transcoders("fake-org/broken")
    assert tc_hub.fetched("fake-org/broken") == {"config.yaml"}  # refused before any layer was fetched
    with pytest.raises(HubNotFoundError, match=r"fake-org/no-such-repo .*no model repo"):
        wb.load_transcoders(_local_config(tmp_path, ["hf://fake-org/no-such-repo/layer_0.safetensors"]))


def test_offline_with_nothing_cached_names_the_repo_and_after_a_download_loads_from_the_cache(tc_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubNotFoundError, match=f"llama: no such file or directory.*{repos.LLAMA}.*HF_HUB_OFFLINE"
                                               ".*config.yaml"):
        wb.load_transcoders("llama")
    assert tc_hub.requests == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    online = wb.load_transcoders("gemma")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(tc_hub.requests)
    offline = wb.load_transcoders("gemma")
    assert len(tc_hub.requests) == before
    assert all(torch.equal(a, b) for a, b in zip(online.state_dict().values(), offline.state_dict().values()))


def test_a_preset_names_whatever_repo_the_table_gives_it(tc_hub, monkeypatch):
    from workbench.hub import transcoder_sources

    monkeypatch.setitem(transcoder_sources.PRESETS, "llama", "fake-org/tc-sets/plt")
    assert_matches_circuit_tracer(wb.load_transcoders("llama"), "plt_listed")


def test_a_download_that_does_not_fit_is_refused_before_any_layer_is_fetched(tc_hub, monkeypatch):
    import shutil as shutil_module
    from collections import namedtuple

    from workbench.hub import disk

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk, "disk_usage", lambda path: usage(100, 100, 0) if Path(path).exists()
                        else shutil_module.disk_usage(path))
    with pytest.raises(HubDiskSpaceError, match=f"{repos.LLAMA}: its files to download"):
        wb.load_transcoders("llama")
    assert tc_hub.fetched(repos.LLAMA) == set()


def test_a_gated_repo_without_a_token_says_to_accept_the_licence_and_set_hf_token(tc_hub):
    tc_hub.add("fake-org/gated-set", repos.fake_repos()[repos.SETS], gated_token="secret")
    with pytest.raises(HubAccessError, match="fake-org/gated-set.*gated.*HF_TOKEN"):
        wb.load_transcoders("fake-org/gated-set/plt")


def test_a_name_that_is_neither_a_path_nor_a_hub_reference_keeps_the_local_error():
    with pytest.raises(CheckpointError, match="no-such-transcoders: no such file or directory"):
        wb.load_transcoders("no-such-transcoders")


def test_a_revision_names_the_commit_whose_files_are_read(tc_hub):
    tagged = {name: data for name, data in repos.fake_repos()[repos.SETS].items() if name.startswith("plt/")}
    tagged.update({f"plt/layer_{i}.safetensors": (FIXTURES / "attribution" / "plt_skip" /
                                                  f"layer_{i}.safetensors").read_bytes() for i in range(3)})
    tc_hub.add(repos.SETS, tagged, ref="v1")
    at_tag, at_main = wb.load_transcoders("fake-org/tc-sets/plt@v1"), wb.load_transcoders("fake-org/tc-sets/plt")
    assert at_tag.skip_connection and not at_main.skip_connection
    assert at_tag.scan == "fake-org/tc-sets//plt@v1"
