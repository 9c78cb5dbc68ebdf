"""wb.load_transcoders: circuit-tracer's per-layer and cross-layer formats, SAELens transcoders, our own directory;
hostile files. Expected values are the files' own tensors (read with safetensors) and SAELens's arithmetic
(wb.SAE, itself checked against SAELens in test_sae_parity)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench.errors import CheckpointError, ConfigError, InputError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "attribution"


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _write_yaml(folder: Path, **changes) -> Path:
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


def test_per_layer_set_holds_the_files_tensors_in_circuit_tracers_orientation():
    tc = wb.load_transcoders(FIXTURES / "plt")
    assert (tc.n_layers, tc.d_model, tc.d_transcoder, tc.cross_layer, tc.skip_connection) == (3, 16, 12, False, False)
    assert tc.input_hook(1) == "blocks.1.ln2.hook_normalized" and tc.output_hook(1) == "blocks.1.hook_mlp_out"
    for layer in range(3):
        file = load_file(str(FIXTURES / "plt" / f"layer_{layer}.safetensors"))
        assert torch.equal(tc.W_enc[layer], file["W_enc"]) and torch.equal(tc.W_dec[layer][:, 0], file["W_dec"])
        assert torch.equal(tc.b_dec[layer], file["b_dec"])
        x = torch.randn(5, 16)
        pre = x @ file["W_enc"].T + file["b_enc"]
        threshold = file.get("activation_function.threshold")
        expected = torch.relu(pre) if threshold is None else pre * (pre > threshold)
        torch.testing.assert_close(tc.encode(layer, x), expected)
    assert tc.threshold[0] is not None and tc.threshold[1] is None   # JumpReLU then ReLU, per file


def test_skip_is_applied_as_circuit_tracer_applies_it_and_hooks_map():
    tc = wb.load_transcoders(FIXTURES / "plt_skip" / "config.yaml")
    file = load_file(str(FIXTURES / "plt_skip" / "layer_2.safetensors"))
    x = torch.randn(4, 16)
    torch.testing.assert_close(tc.skip(2, x), x @ file["W_skip"].T)   # circuit-tracer: input_acts @ W_skip.T
    assert tc.input_hook(0) == "blocks.0.hook_resid_mid" and tc.output_hook(0) == "blocks.0.hook_mlp_out"


def test_cross_layer_transcoder_writes_to_every_later_layer():
    tc = wb.load_transcoders(FIXTURES / "clt")
    assert tc.cross_layer and [tc.W_dec[i].shape[1] for i in range(3)] == [3, 2, 1]
    assert list(tc.output_layers(1)) == [1, 2]
    dec = load_file(str(FIXTURES / "clt" / "W_dec_1.safetensors"))["W_dec_1"]
    assert torch.equal(tc.W_dec[1], dec)


def test_absolute_paths_and_a_folder_without_a_list(tmp_path):
    folder = _copy("plt", tmp_path)
    _write_yaml(folder, transcoders=[str((folder / f"layer_{i}.safetensors").resolve()) for i in range(3)])
    assert torch.equal(wb.load_transcoders(folder).W_enc[2], wb.load_transcoders(FIXTURES / "plt").W_enc[2])
    _write_yaml(folder, transcoders=None)
    assert wb.load_transcoders(folder).n_layers == 3


def test_our_format_round_trips_a_cross_layer_transcoder(tmp_path):
    tc = wb.load_transcoders(FIXTURES / "clt")
    back = wb.load_transcoders(tc.save(tmp_path / "ours"))
    assert back.feature_input_hook == "hook_resid_mid" and back.scan == tc.scan
    for layer in range(3):
        assert torch.equal(back.W_dec[layer], tc.W_dec[layer]) and torch.equal(back.W_enc[layer], tc.W_enc[layer])


def _saelens_transcoder(layer: int, arch: str, threshold: torch.Tensor | None = None) -> wb.SAE:
    torch.manual_seed(layer)
    cfg = wb.SAEConfig(arch, d_in=16, d_sae=8, d_out=16, apply_b_dec_to_input=False, metadata=wb.SAEMetadata(
        hook_name=f"blocks.{layer}.ln2.hook_normalized", hook_name_out=f"blocks.{layer}.hook_mlp_out"))
    tensors = {"W_enc": torch.randn(16, 8), "W_dec": torch.randn(8, 16), "b_enc": torch.randn(8), "b_dec": torch.randn(16)}
    if "jumprelu" in arch:
        tensors["threshold"] = threshold
    if "skip" in arch:
        tensors["W_skip"] = torch.randn(16, 16)
    return wb.SAE.from_tensors(cfg, tensors)


def test_saelens_transcoders_encode_as_saelens_does(tmp_path):
    threshold = torch.linspace(-1.0, 1.0, 8)      # negative thresholds: SAELens's ReLU still applies
    saes = [_saelens_transcoder(i, "jumprelu_skip_transcoder", threshold) for i in range(3)]
    paths = [sae.save(tmp_path / f"layer_{i}") for i, sae in enumerate(saes)]
    for tc in (wb.load_transcoders(paths), wb.load_transcoders(tmp_path)):
        assert tc.input_hook(2) == "blocks.2.ln2.hook_normalized" and tc.skip_connection
        x = torch.randn(6, 16)
        for layer, sae in enumerate(saes):
            torch.testing.assert_close(tc.encode(layer, x), sae.encode(x).detach())
            torch.testing.assert_close(tc.W_dec[layer][:, 0] * 1, sae.W_dec.detach())
            torch.testing.assert_close(tc.skip(layer, x), x @ sae.W_skip.detach().T)


def test_saelens_sets_must_cover_every_layer_with_transcoders(tmp_path):
    _saelens_transcoder(1, "transcoder").save(tmp_path / "a")
    with pytest.raises(ConfigError, match=r"covers? layers \[1\]"):
        wb.load_transcoders(tmp_path)
    sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=4, d_sae=2, metadata=wb.SAEMetadata(
        hook_name="blocks.0.hook_resid_pre")), {"W_enc": torch.ones(4, 2), "W_dec": torch.ones(2, 4),
                                                "b_enc": torch.zeros(2), "b_dec": torch.zeros(4)})
    with pytest.raises(ConfigError, match="not a transcoder"):
        wb.load_transcoders([sae.save(tmp_path / "plain")])


@pytest.mark.parametrize("changes, error, match", [
    ({"model_kind": "sparse_autoencoder"}, ConfigError, "field 'model_kind' must be one of"),
    ({"feature_input_hook": None}, ConfigError, "field 'feature_input_hook'"),
    ({"feature_output_hook": "blocks.0.hook_mlp_out"}, ConfigError, "feature_output_hook must name a hook inside"),
    ({"transcoders": ["hf://mntss/x/layer_0.safetensors"]}, CheckpointError, "mntss/x.*HF_HUB_OFFLINE.*layer_0"),
    ({"transcoders": ["hf://mntss/x/../layer_0.safetensors"]}, ConfigError, "'..' step"),
    ({"transcoders": ["s3://bucket/layer_0.safetensors"]}, ConfigError, "the one address scheme read is hf://"),
    ({"transcoders": ["../../etc/layer_0.safetensors"]}, ConfigError, "resolves outside the config's folder"),
    ({"transcoders": ["layer_0.safetensors", "layer_9.safetensors"]}, CheckpointError, "layer_9.safetensors: missing"),
    ({"transcoders": "layer_0.safetensors"}, ConfigError, "field 'transcoders' must be a non-empty list"),
])
def test_hostile_configs_name_the_field(tmp_path, changes, error, match):
    folder = _write_yaml(_copy("plt", tmp_path), **changes)
    with pytest.raises(error, match=match):
        wb.load_transcoders(folder)


def test_hostile_yaml_and_tensors_name_the_file_and_tensor(tmp_path):
    folder = _copy("plt", tmp_path)
    (folder / "config.yaml").write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        wb.load_transcoders(folder)
    (folder / "config.yaml").write_text("model_kind: [unclosed\n")
    with pytest.raises(CheckpointError, match="not a readable YAML"):
        wb.load_transcoders(folder)
    shutil.copy(FIXTURES / "plt" / "config.yaml", folder / "config.yaml")
    layer = load_file(str(folder / "layer_1.safetensors"))
    bad = {**layer, "b_enc": layer["b_enc"].clone()}
    bad["b_enc"][0] = float("nan")
    save_file(bad, str(folder / "layer_1.safetensors"))
    with pytest.raises(CheckpointError, match=r"b_enc\[1\] holds NaN"):
        wb.load_transcoders(folder)
    save_file({k: v for k, v in layer.items() if k != "W_dec"}, str(folder / "layer_1.safetensors"))
    with pytest.raises(CheckpointError, match=r"layer_1.safetensors: missing tensor 'W_dec'"):
        wb.load_transcoders(folder)
    save_file({**layer, "W_dec": layer["W_dec"][:, :8].contiguous()}, str(folder / "layer_1.safetensors"))
    with pytest.raises(CheckpointError, match=r"W_dec\[1\] has shape"):
        wb.load_transcoders(folder)
    (folder / "layer_1.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        wb.load_transcoders(folder)


def test_a_cross_layer_transcoder_missing_a_decoder_file(tmp_path):
    folder = _copy("clt", tmp_path)
    (folder / "W_dec_2.safetensors").unlink()
    with pytest.raises(CheckpointError, match="W_dec_2.safetensors: missing"):
        wb.load_transcoders(folder)


def test_built_from_tensors_checks_shapes():
    with pytest.raises(InputError, match=r"W_dec\[0\] has shape"):
        wb.TranscoderSet(W_enc=[torch.ones(2, 3)], b_enc=[torch.zeros(2)], threshold=[None], W_dec=[torch.ones(2, 3)],
                         b_dec=torch.zeros(1, 3), feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out")
