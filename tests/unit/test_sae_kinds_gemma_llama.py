"""SAELens's gemma_2, gemma_3, llama_scope, llama_scope_r1_distill and dictionary_learning_1 releases, loaded from a
(fake, loopback) Hub by ``wb.load_sae(release, sae_id)``.

Expected values: SAELens 6.54.12 itself, through ``SAE.from_pretrained`` on the same files served by the same fake
hub (tests/fixtures/sae_kinds/make_gemma_llama.py: each case's repo files, SAELens's encode / decode of fixed inputs
and its config in expected.json). Gemma Scope reads its sizes from the repo id and folder (d_in 2304 for "2b"), so
the tiny gemma_2 cases carry ``config_overrides`` (d_in, d_sae), as SAELens's registry can; the parsing itself is
checked against SAELens's own reading of the real registry's names (gemma_parsing.json).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from tests.hub_server import files_of, hub  # noqa: F401  (the fixture)
from workbench.hub import sae_releases
from workbench.sae.foreign.gemma_scope import gemma_2_config, gemma_3_inferred_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sae_kinds"
CASES = sorted(path.name for path in FIXTURES.iterdir()
               if (path / "expected.json").is_file() and path.name.startswith(("gemma_", "llama_", "dl_")))
# The config fields SAELens sets that a workbench SAEConfig holds (metadata compared key by key).
FIELDS = ("architecture", "d_in", "d_sae", "dtype", "apply_b_dec_to_input", "normalize_activations",
          "reshape_activations", "d_out", "k", "rescale_acts_by_decoder_norm")


def _expected(case: str) -> dict:
    return json.loads((FIXTURES / case / "expected.json").read_text())


@pytest.fixture
def kinds_hub(hub, monkeypatch):  # noqa: F811
    """Every case's repo on the fake hub and its release in a test-only registry."""
    repos: dict[str, dict[str, bytes]] = {}
    table = {}
    for case in CASES:
        expected = _expected(case)
        repos.setdefault(expected["row"]["repo_id"], {}).update(files_of(FIXTURES / case / "repo"))
        table[expected["release"]] = expected["row"]
    for repo_id, files in repos.items():
        hub.add(repo_id, files)
    monkeypatch.setattr(sae_releases, "_RELEASES", table)
    return hub


def _add_release(monkeypatch, hub, name: str, conversion: str, repo_id: str, files: dict[str, bytes], path: str,
                 **row) -> None:
    hub.add(repo_id, files)
    table = dict(sae_releases.releases())
    table[name] = {"repo_id": repo_id, "model": "toy", "conversion": conversion,
                   "saes": [{"id": "sae", "path": path}], **row}
    monkeypatch.setattr(sae_releases, "_RELEASES", table)


@pytest.mark.parametrize("case", CASES)
def test_each_kind_encodes_decodes_and_configures_as_saelens(kinds_hub, case):
    expected = _expected(case)
    sae = wb.load_sae(expected["release"], expected["row"]["saes"][0]["id"])
    tensors = load_file(str(FIXTURES / case / "expected.safetensors"))
    with torch.no_grad():
        features = sae.encode(tensors["x"])
        torch.testing.assert_close(features, tensors["encode"], atol=1e-5, rtol=0)
        torch.testing.assert_close(sae.decode(features), tensors["decode"], atol=1e-5, rtol=0)
    theirs, ours = expected["cfg"], sae.cfg.to_dict()
    for name in FIELDS:
        if name in theirs:
            assert ours[name] == theirs[name], name
    for key, value in theirs["metadata"].items():
        if key != "sae_lens_version":  # SAELens stamps its own version on what it builds
            assert sae.cfg.metadata[key] == value, key
    fetched = {r.path.split("/resolve/main/", 1)[-1] for r in kinds_hub.file_requests("GET")}
    assert fetched == set(files_of(FIXTURES / case / "repo"))  # what the kind reads, nothing else


def test_gemma_scope_names_are_read_as_saelens_reads_them():
    parsed = json.loads((FIXTURES / "gemma_parsing.json").read_text())
    for case in parsed["gemma_2"]:
        if "error" in case:
            with pytest.raises(wb.ConfigError, match="layer_N"):
                gemma_2_config(case["repo_id"], case["folder"])
        elif case["cfg"]["d_sae"] is None:  # SAELens would build nothing of it; here it is said at once
            with pytest.raises(wb.ConfigError, match="no width"):
                gemma_2_config(case["repo_id"], case["folder"])
        else:
            assert gemma_2_config(case["repo_id"], case["folder"]) == case["cfg"], case["folder"]
    for case in parsed["gemma_3"]:
        if "error" in case:
            with pytest.raises(wb.ConfigError, match="layer_N"):
                gemma_3_inferred_config(case["repo_id"], case["folder"])
        else:
            assert gemma_3_inferred_config(case["repo_id"], case["folder"]) == case["raw"], case["folder"]


def test_gemma_scope_att_width_by_hand():
    # SAELens's table: an attention SAE of gemma-2-9b reads hook_z of 16 heads x 256 = 4096, not d_model 3584;
    # its "-it" repo matches the "9b-it" key, which that table lacks, so it keeps d_model.
    assert gemma_2_config("google/gemma-scope-9b-pt-att", "layer_0/width_16k/x")["d_in"] == 4096
    assert gemma_2_config("google/gemma-scope-9b-it-att", "layer_0/width_16k/x")["d_in"] == 3584


def test_an_embedding_sae_is_rescaled_by_the_square_root_of_d_in(kinds_hub):
    # By hand: SAELens divides W_enc and multiplies W_dec by sqrt(d_in) = 4 for d_in 16.
    expected = _expected("gemma_2_embedding")
    sae = wb.load_sae(expected["release"], expected["row"]["saes"][0]["id"])
    stored = np.load(FIXTURES / "gemma_2_embedding" / "repo" / expected["row"]["saes"][0]["path"] / "params.npz")
    torch.testing.assert_close(sae.W_enc, torch.from_numpy(stored["W_enc"]) / 4)
    torch.testing.assert_close(sae.W_dec, torch.from_numpy(stored["W_dec"]) * 4)
    assert sae.cfg.hook_name == "hook_embed"


def test_gemma_scope_2_reads_its_config_json_where_the_repo_has_one_and_infers_it_where_not(kinds_hub):
    for case, config_fetched in (("gemma_3_res", True), ("gemma_3_affine_transcoder", False)):
        expected = _expected(case)
        folder = expected["row"]["saes"][0]["path"]
        kinds_hub.requests.clear()
        wb.load_sae(expected["release"], expected["row"]["saes"][0]["id"])
        got = {r.path.split("/resolve/main/", 1)[-1] for r in kinds_hub.file_requests("GET")}
        asked = {r.path.split("/resolve/main/", 1)[-1] for r in kinds_hub.file_requests("HEAD")}
        assert f"{folder}/config.json" in asked
        assert got == ({f"{folder}/config.json"} if config_fetched else set()) | {f"{folder}/params.safetensors"}


def test_gemma_scope_2_without_config_json_loads_offline_once_cached(kinds_hub, monkeypatch):
    expected = _expected("gemma_3_affine_transcoder")
    release, sae_id = expected["release"], expected["row"]["saes"][0]["id"]
    online = wb.load_sae(release, sae_id)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = wb.load_sae(release, sae_id)
    assert torch.equal(offline.W_skip, online.W_skip) and offline.cfg.hook_name_out == "blocks.2.hook_mlp_out"


def test_gemma_scope_2_offline_with_nothing_cached_names_the_repo_and_file(kinds_hub, monkeypatch):
    expected = _expected("gemma_3_res")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(wb.CheckpointError, match="google/gemma-scope-2-270m-pt.*HF_HUB_OFFLINE.*params.safetensors"):
        wb.load_sae(expected["release"], expected["row"]["saes"][0]["id"])


def test_a_pickle_inside_params_npz_is_refused_unread(hub, monkeypatch, tmp_path):  # noqa: F811
    path = tmp_path / "params.npz"
    np.savez(path, W_enc=np.array([{"not": "weights"}], dtype=object))
    _add_release(monkeypatch, hub, "evil-gemma", "gemma_2", "google/gemma-scope-2b-pt-res",
                 {"layer_0/width_16k/x/params.npz": path.read_bytes()}, "layer_0/width_16k/x")
    with pytest.raises(wb.CheckpointError, match="params.npz: not a readable .npz file.*pickle"):
        wb.load_sae("evil-gemma", "sae")


class _RunsCode:
    """Pickles as a call of os.system: what torch.load(weights_only=True) must never make."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_an_ae_pt_holding_more_than_weights_is_refused_and_never_run(hub, monkeypatch, tmp_path):  # noqa: F811
    marker, path = tmp_path / "ran", tmp_path / "ae.pt"
    torch.save({"encoder.weight": torch.ones(4, 2), "payload": _RunsCode(marker)}, str(path))
    folder = "evil/resid_post_layer_0/trainer_0"
    config = json.dumps({"trainer": {"dict_class": "AutoEncoder", "activation_dim": 2, "dict_size": 4, "layer": 0,
                                     "lm_name": "toy"}, "buffer": {"ctx_len": 8}}).encode()
    _add_release(monkeypatch, hub, "evil-dl", "dictionary_learning_1", "org/evil-saes",
                 {f"{folder}/config.json": config, f"{folder}/ae.pt": path.read_bytes()}, folder)
    with pytest.raises(wb.CheckpointError, match="ae.pt: not a readable weights-only torch file"):
        wb.load_sae("evil-dl", "sae")
    assert not marker.exists()


def test_a_llama_scope_tensor_of_the_wrong_shape_is_named(hub, monkeypatch, tmp_path):  # noqa: F811
    folder = "Llama3_1-8B-Base-L0R-8x"
    hyperparams = json.dumps({"d_model": 16, "d_sae": 32, "hook_point_in": "blocks.0.hook_resid_post",
                              "jump_relu_threshold": 0.1, "dataset_average_activation_norm": {"in": 4.0}}).encode()
    save_file({"encoder.weight": torch.zeros(32, 17), "encoder.bias": torch.zeros(32),
               "decoder.weight": torch.zeros(16, 32), "decoder.bias": torch.zeros(16)}, str(tmp_path / "final"))
    _add_release(monkeypatch, hub, "bad-llama", "llama_scope", "fnlp/Llama3_1-8B-Base-LXR-8x",
                 {f"{folder}/hyperparams.json": hyperparams,
                  f"{folder}/checkpoints/final.safetensors": (tmp_path / "final").read_bytes()}, folder)
    with pytest.raises(wb.CheckpointError, match=r"tensor 'W_enc' has shape \(17, 32\), expected \[d_in, d_sae\] = "
                                                 r"\(16, 32\)"):
        wb.load_sae("bad-llama", "sae")


def test_a_gemma_scope_2_file_that_is_not_safetensors_is_named(hub, monkeypatch):  # noqa: F811
    folder = "resid_post/layer_1_width_16k_l0_small"
    _add_release(monkeypatch, hub, "bad-gemma-3", "gemma_3", "google/gemma-scope-2-1b-pt",
                 {f"{folder}/params.safetensors": b"\xff" * 64}, folder)
    with pytest.raises(wb.CheckpointError, match="params.safetensors: not a readable safetensors file"):
        wb.load_sae("bad-gemma-3", "sae")


def test_a_dictionary_learning_config_without_its_sizes_is_a_config_error(hub, monkeypatch):  # noqa: F811
    folder = "sweep/resid_post_layer_0/trainer_0"
    config = json.dumps({"trainer": {"dict_class": "AutoEncoder", "layer": 0, "lm_name": "toy"},
                         "buffer": {"ctx_len": 8}}).encode()
    _add_release(monkeypatch, hub, "sizeless-dl", "dictionary_learning_1", "org/sizeless",
                 {f"{folder}/config.json": config, f"{folder}/ae.pt": b"unread"}, folder)
    with pytest.raises(wb.ConfigError, match="'trainer.activation_dim' must be an integer, got None"):
        wb.load_sae("sizeless-dl", "sae")


def test_a_params_npz_of_complex_numbers_is_refused(hub, monkeypatch, tmp_path):  # noqa: F811
    path = tmp_path / "params.npz"
    np.savez(path, W_enc=np.ones((16, 32), dtype=np.complex64))
    _add_release(monkeypatch, hub, "complex-gemma", "gemma_2", "google/gemma-scope-2b-pt-res",
                 {"layer_0/width_16k/x/params.npz": path.read_bytes()}, "layer_0/width_16k/x")
    with pytest.raises(wb.CheckpointError, match=r"params.npz: arrays \['W_enc'\] are not real numbers"):
        wb.load_sae("complex-gemma", "sae")
