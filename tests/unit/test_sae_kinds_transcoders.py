"""SAELens's transcoder conversion kinds by release name: ``gemma_2_transcoder``, ``mwhanna_transcoder`` and
``mntss_clt_layer_transcoder``, served by a (fake, loopback) Hub under test-only registry rows.

Expected values: SAELens 6.54.12's own loaders (``SAE.from_pretrained(repo, folder, converter=...)``) reading the same
fake Hub (``tests/fixtures/tc_hub/make_fixtures.py``): encode, decode and ``cfg.to_dict()``. For the two mwhanna files
SAELens refuses (a JumpReLU threshold, a ``W_skip``: its plain ``transcoder`` has no such parameter), circuit-tracer
0.5.0's reading of the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from tests.fixtures.tc_hub import repos
from tests.hub_server import hub  # noqa: F401  (the fixture)
from workbench.hub import sae_releases
from workbench.hub.errors import HubNotFoundError
from workbench.sae.foreign import KINDS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tc_hub"
EXPECTED = load_file(str(FIXTURES / "expected.safetensors"))
META = json.loads((FIXTURES / "expected.json").read_text())
# Metadata SAELens stamps on every config it loads (its version, training version), and the null neuronpedia_id its
# pre-6.0 handling adds, which our reader (workbench.sae.config) leaves out.
STAMPED = {"sae_lens_version", "sae_lens_training_version", "neuronpedia_id"}


@pytest.fixture
def releases(hub, monkeypatch):  # noqa: F811
    for repo_id, files in repos.fake_repos().items():
        hub.add(repo_id, files)
    monkeypatch.setattr(sae_releases, "_RELEASES", repos.RELEASES)
    return hub


def check_against_saelens(sae: wb.SAE, key: str) -> None:
    x = EXPECTED[f"{key}.x"]
    with torch.no_grad():
        features = sae.encode(x)
        torch.testing.assert_close(features, EXPECTED[f"{key}.encode"], atol=1e-5, rtol=0)
        torch.testing.assert_close(sae.decode(features), EXPECTED[f"{key}.decode"], atol=1e-5, rtol=0)
    ours, theirs = sae.cfg.to_dict(), META["saelens_cfg"][key]
    for field in ("architecture", "d_in", "d_sae", "d_out", "apply_b_dec_to_input", "normalize_activations", "dtype",
                  "reshape_activations"):
        assert ours[field] == theirs[field], field
    their_metadata = {k: v for k, v in theirs["metadata"].items() if k not in STAMPED}
    assert {k: v for k, v in ours["metadata"].items() if k not in STAMPED} == their_metadata


def test_the_three_transcoder_kinds_are_loaded_natively():
    assert {"gemma_2_transcoder", "mwhanna_transcoder", "mntss_clt_layer_transcoder"} <= set(KINDS)


def test_a_gemma_scope_transcoder_takes_its_sizes_from_its_names_as_saelens_does(releases):
    sae = wb.load_sae("fake-gemma-scope-transcoders", "layer_1/width_1k/canonical")
    check_against_saelens(sae, "fake-gemma-scope-transcoders/layer_1/width_1k/canonical")
    assert (sae.cfg.d_in, sae.cfg.d_sae) == (2304, 1024)  # "2b" in the repo id, "width_1k" in the folder
    assert sae.cfg.metadata.neuronpedia_id == "gemma-2-2b/1-fake-transcoder"
    assert releases.fetched(repos.GEMMA_2_KIND) == {f"{repos.GEMMA_2_FOLDER}/params.npz"}


@pytest.mark.parametrize("release, sae_id", [("fake-qwen3-0.6b-transcoders", "layer_1"),
                                             ("fake-qwen3-0.6b-transcoders", "layer_2"),
                                             ("fake-qwen3-14b-transcoders", "layer_2")])
def test_an_mwhanna_transcoder_matches_saelens(releases, release, sae_id):
    check_against_saelens(wb.SAE.from_pretrained(release, sae_id), f"{release}/{sae_id}")


def test_an_mwhanna_repo_with_the_typo_config_and_no_base_config_names_its_model_from_the_repo_id(releases):
    sae = wb.load_sae("fake-qwen3-14b-transcoders", "layer_2")
    assert sae.cfg.metadata.model_name == "Qwen/Qwen3-14B"
    assert releases.fetched(repos.MWHANNA_14B) == {"wanb-config.yaml", "layer_2.safetensors"}
    assert releases.fetched(repos.MWHANNA) == set()


@pytest.mark.parametrize("release, sae_id, architecture", [
    ("fake-qwen3-0.6b-transcoders", "layer_0", "jumprelu_transcoder"),
    ("fake-qwen3-14b-transcoders", "layer_0", "jumprelu_skip_transcoder")])
def test_mwhanna_files_saelens_refuses_load_as_circuit_tracer_computes_them(releases, release, sae_id, architecture):
    key = f"{release}/{sae_id}"
    assert "Unexpected key" in META["saelens_refuses"][key]
    sae = wb.load_sae(release, sae_id)
    assert sae.cfg.architecture() == architecture
    x = EXPECTED[f"{key}.x"]
    with torch.no_grad():
        torch.testing.assert_close(sae.encode(x), EXPECTED[f"{key}.encode"], atol=1e-5, rtol=0)
        torch.testing.assert_close(sae(x), EXPECTED[f"{key}.decode"], atol=1e-5, rtol=0)  # with the skip term


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_a_clt_layer_loads_as_a_per_layer_transcoder_summing_its_decoders_with_saelens_warning(releases, layer):
    with pytest.warns(UserWarning, match="summing all decoders together"):
        sae = wb.load_sae("fake-clt-as-per-layer", f"layer_{layer}")
    check_against_saelens(sae, f"fake-clt-as-per-layer/layer_{layer}")
    assert releases.fetched(repos.CLT_KIND) == {"config.yaml", f"W_enc_{layer}.safetensors",
                                                 f"W_dec_{layer}.safetensors"}


def test_names_saelens_cannot_read_sizes_from_are_config_errors_naming_them(releases, monkeypatch):
    table = {name: dict(row) for name, row in repos.RELEASES.items()}
    table["fake-gemma-scope-transcoders"]["saes"] = [{"id": "no-width", "path": "layer_1/average_l0_9"}]
    monkeypatch.setattr(sae_releases, "_RELEASES", table)
    with pytest.raises(wb.ConfigError, match="layer_1/average_l0_9: no dictionary size in the folder name"):
        wb.load_sae("fake-gemma-scope-transcoders", "no-width")
    assert releases.requests == []  # refused from the names, before any download (as SAELens)


def test_offline_with_nothing_cached_names_the_repo_and_files(releases, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubNotFoundError, match=f"{repos.CLT_KIND}.*HF_HUB_OFFLINE.*config.yaml"):
        wb.load_sae("fake-clt-as-per-layer", "layer_0")
    with pytest.raises(HubNotFoundError, match=f"{repos.MWHANNA}.*HF_HUB_OFFLINE.*wandb-config.yaml"):
        wb.load_sae("fake-qwen3-0.6b-transcoders", "layer_1")
    assert releases.requests == []


def test_a_tampered_layer_file_is_a_checkpoint_error_naming_it(releases):
    files = dict(repos.fake_repos()[repos.MWHANNA])
    files["layer_1.safetensors"] = (repos.ATTRIBUTION / "clt" / "W_enc_0.safetensors").read_bytes()
    releases.add(repos.MWHANNA, files)
    with pytest.raises(wb.CheckpointError, match="layer_1.safetensors: missing tensor 'W_dec', 'W_enc'"):
        wb.load_sae("fake-qwen3-0.6b-transcoders", "layer_1")
