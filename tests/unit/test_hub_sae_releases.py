"""SAEs by SAELens release name: the registry carried over from SAELens 6.54.12's pretrained_saes.yaml, the
listing, and ``sae_lens``-kind SAEs fetched from a (fake, loopback) Hub.

Expected values: the SAELens fixtures under tests/fixtures/sae (written by SAELens 6.54.12 itself, with its
outputs in expected.safetensors), served as a release's folder; the norm-scaling fold by hand (W_enc times f,
W_dec and b_dec divided by f: encode(x) is the unfolded encode of f x, decode is the unfolded decode over f).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from tests.hub_server import files_of, hub  # noqa: F401  (the fixture)
from workbench.hub import sae_releases

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sae"
REPO = "tiny-org/tiny-saes"


def test_the_registry_holds_saelens_6_54_12s_releases():
    table = sae_releases.releases()
    assert len(table) == 170  # counted from the YAML with PyYAML
    assert sum(len(row["saes"]) for row in table.values()) == 13857
    jb = table["gpt2-small-res-jb"]
    assert (jb["repo_id"], jb["model"], jb["conversion"]) == ("jbloom/GPT2-Small-SAEs-Reformatted", "gpt2-small",
                                                               "sae_lens")
    assert jb["config_overrides"] == {"model_from_pretrained_kwargs": {"center_writing_weights": True}}
    assert jb["saes"][8] == {"id": "blocks.8.hook_resid_pre", "path": "blocks.8.hook_resid_pre",
                             "neuronpedia": "gpt2-small/8-res-jb"}
    canonical = sae_releases.lookup("gemma-scope-2b-pt-res-canonical", "layer_12/width_16k/canonical")
    assert canonical[0]["conversion"] == "gemma_2"
    assert canonical[1]["path"] == "layer_12/width_16k/average_l0_82"
    assert table["mistral-7b-res-wg"]["config_overrides"] == {"normalize_activations": "constant_norm_rescale"}
    scaled = [entry for row in table.values() for entry in row["saes"] if "norm_scaling_factor" in entry]
    assert len(scaled) == 304
    kinds = {row["conversion"] for row in table.values()}
    assert kinds <= set(sae_releases.CONVERSION_KINDS) and len(kinds) == 14


def test_pretrained_saes_lists_and_filters_by_model():
    everything = wb.pretrained_saes()
    assert list(everything.columns) == ["release", "repo_id", "model", "conversion", "n_saes"]
    assert len(everything) == 170
    gpt2 = wb.pretrained_saes(model="gpt2-small")
    assert len(gpt2) == 18 and set(gpt2.model) == {"gpt2-small"}
    assert gpt2.set_index("release").loc["gpt2-small-res-jb", "n_saes"] == 13
    with pytest.raises(wb.InputError, match="'gpt2'.*'gpt2-small'"):
        wb.pretrained_saes(model="gpt2")


@pytest.fixture
def fake_release(hub, monkeypatch):  # noqa: F811
    """A release of two SAELens folders written by SAELens, in a test-only registry."""
    files = {}
    for case, folder in (("jumprelu", "layer_0/width_32"), ("standard_expected_average_only_in", "layer_1/scaled"),
                         ("pre6_standard", "old/blocks.0")):
        files.update({f"{folder}/{name}": data for name, data in files_of(FIXTURES / case).items()
                      if name in ("cfg.json", "sae_weights.safetensors")})
    files["README.md"] = b"# not fetched"
    hub.add(REPO, files)
    table = {"tiny-release": {"repo_id": REPO, "model": "toy", "conversion": "sae_lens",
                              "config_overrides": {"dataset_path": "org/corpus"},
                              "saes": [{"id": "l0", "path": "layer_0/width_32", "neuronpedia": "toy/0-tiny"},
                                       {"id": "scaled", "path": "layer_1/scaled", "norm_scaling_factor": 2.5},
                                       {"id": "old", "path": "old/blocks.0", "neuronpedia": "toy/old"}]},
             "tiny-gemma": {"repo_id": REPO, "model": "toy", "conversion": "gemma_2",
                            "saes": [{"id": "l0", "path": "layer_0/width_32"}]}}
    monkeypatch.setattr(sae_releases, "_RELEASES", table)
    return hub


def test_a_sae_lens_release_loads_as_saelens_and_as_the_local_folder(fake_release):
    sae = wb.load_sae("tiny-release", "l0")
    local = wb.load_sae(FIXTURES / "jumprelu")
    expected = load_file(str(FIXTURES / "jumprelu" / "expected.safetensors"))
    with torch.no_grad():
        features = sae.encode(expected["x"])
        assert torch.equal(features, local.encode(expected["x"]))
        assert torch.equal(sae.decode(features), local.decode(features))
        torch.testing.assert_close(features, expected["encode"], atol=1e-5, rtol=0)
        torch.testing.assert_close(sae.decode(features), expected["decode"], atol=1e-5, rtol=0)
    assert sae.cfg.metadata.neuronpedia_id == "toy/0-tiny"
    fetched = {r.path.split("/resolve/main/", 1)[-1] for r in fake_release.file_requests("GET")}
    assert fetched == {"layer_0/width_32/cfg.json", "layer_0/width_32/sae_weights.safetensors"}
    again = wb.SAE.from_pretrained("tiny-release", "l0", dtype=torch.float64)
    assert again.dtype == torch.float64 and torch.equal(again.W_enc, local.W_enc.double())


def test_a_pre_6_config_takes_the_release_overrides_into_its_metadata(fake_release):
    sae = wb.load_sae("tiny-release", "old")
    assert sae.cfg.metadata.neuronpedia_id == "toy/old"
    assert sae.cfg.metadata.dataset_path == "org/corpus"  # SAELens's LLM_METADATA_KEYS, from config_overrides
    assert sae.cfg.metadata.hook_name == "blocks.0.hook_resid_pre"


def test_the_norm_scaling_factor_is_folded_as_saelens_does(fake_release):
    sae = wb.load_sae("tiny-release", "scaled")
    unfolded = wb.load_sae(FIXTURES / "standard_expected_average_only_in")
    assert unfolded.cfg.normalize_activations == "expected_average_only_in"
    assert sae.cfg.normalize_activations == "none"
    x = load_file(str(FIXTURES / "standard_expected_average_only_in" / "expected.safetensors"))["x"]
    with torch.no_grad():
        features = sae.encode(x)
        torch.testing.assert_close(features, unfolded.encode(2.5 * x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sae.decode(features), unfolded.decode(features) / 2.5, atol=1e-5, rtol=1e-5)


def test_a_cached_release_sae_loads_offline(fake_release, monkeypatch):
    online = wb.load_sae("tiny-release", "l0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = wb.load_sae("tiny-release", "l0")
    assert torch.equal(offline.W_enc, online.W_enc)


def test_offline_with_nothing_cached_names_the_repo_and_files(fake_release, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(wb.CheckpointError, match=f"{REPO}.*HF_HUB_OFFLINE.*layer_0/width_32/cfg.json"):
        wb.load_sae("tiny-release", "l0")


def test_unknown_release_or_sae_id_names_it_with_close_matches(fake_release):
    with pytest.raises(wb.InputError, match="no SAELens release 'tiny-relase'.*did you mean 'tiny-release'"):
        wb.load_sae("tiny-relase", "l0")
    with pytest.raises(wb.InputError, match="release 'tiny-release' has no SAE 'l00'.*did you mean 'l0'"):
        wb.SAE.from_pretrained("tiny-release", "l00")


def test_a_conversion_kind_not_loaded_yet_is_a_config_error_naming_it(fake_release, monkeypatch):
    table = dict(sae_releases.releases())
    table["tiny-unknown-kind"] = {"repo_id": REPO, "model": "toy", "conversion": "made_up_kind",
                                  "saes": [{"id": "l0", "path": "layer_0/width_32"}]}
    monkeypatch.setattr(sae_releases, "_RELEASES", table)
    with pytest.raises(wb.ConfigError, match="SAELens's 'made_up_kind' form is not loaded yet.*loaded: 'sae_lens'"):
        wb.load_sae("tiny-unknown-kind", "l0")
    assert fake_release.file_requests("GET") == []


def test_a_missing_folder_on_the_hub_is_an_error_naming_the_repo(fake_release, monkeypatch):
    table = dict(sae_releases.releases())
    table["tiny-missing"] = {"repo_id": REPO, "model": "toy", "conversion": "sae_lens",
                             "saes": [{"id": "gone", "path": "no/such/folder"}]}
    monkeypatch.setattr(sae_releases, "_RELEASES", table)
    with pytest.raises(wb.CheckpointError, match=f"{REPO}.*no/such/folder/cfg.json"):
        wb.load_sae("tiny-missing", "gone")
