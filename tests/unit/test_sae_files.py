"""Hostile SAE directories and configs: each is a ``CheckpointError`` / ``ConfigError`` naming the file and the
field or tensor at fault, and nothing is built."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sae"


@pytest.fixture
def sae_dir(tmp_path):
    target = tmp_path / "sae"
    shutil.copytree(FIXTURES / "jumprelu", target)
    return target


def edit_config(folder: Path, **changes):
    cfg = json.loads((folder / "cfg.json").read_text())
    cfg.update(changes)
    (folder / "cfg.json").write_text(json.dumps(cfg))


def edit_weights(folder: Path, change):
    tensors = load_file(str(folder / "sae_weights.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "sae_weights.safetensors"))


def test_missing_directory_and_files(sae_dir):
    with pytest.raises(wb.CheckpointError, match="no such directory"):
        wb.load_sae(sae_dir / "nope")
    (sae_dir / "sae_weights.safetensors").unlink()
    with pytest.raises(wb.CheckpointError, match="sae_weights.safetensors: missing"):
        wb.load_sae(sae_dir)


def test_unreadable_config_and_weights(sae_dir):
    (sae_dir / "sae_weights.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(wb.CheckpointError, match="not a readable safetensors file"):
        wb.load_sae(sae_dir)
    (sae_dir / "cfg.json").write_text("{not json")
    with pytest.raises(wb.CheckpointError, match="cfg.json: not a readable JSON file"):
        wb.load_sae(sae_dir)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("threshold"), r"missing 'threshold' \(a jumprelu SAE stores"),
    (lambda t: t.update(extra=torch.zeros(3)), "unexpected 'extra'"),
    (lambda t: t.update(W_enc=torch.zeros(16, 31)), r"tensor 'W_enc' has shape \(16, 31\), expected \[d_in, d_sae\] = \(16, 32\)"),
    (lambda t: t["b_dec"].__setitem__(3, float("nan")), "tensor 'b_dec' holds NaN or infinity"),
    (lambda t: t["W_dec"].__setitem__((0, 0), float("inf")), "tensor 'W_dec' holds NaN or infinity"),
    (lambda t: t.update(b_enc=torch.zeros(32, dtype=torch.int32)), "tensor 'b_enc' must be a floating-point tensor"),
])
def test_bad_weights_name_the_tensor(sae_dir, change, message):
    edit_weights(sae_dir, change)
    with pytest.raises(wb.CheckpointError, match=message):
        wb.load_sae(sae_dir)


@pytest.mark.parametrize("changes, field", [
    (dict(architecture="matryoshka_topk_v9"), "'architecture'"),   # no such SAELens architecture (Matryoshka checkpoints load)
    (dict(normalize_activations="covariance_whitening"), "normalize_activations"),
    (dict(normalize_activations="whatever"), "normalize_activations"),
    (dict(reshape_activations="hook_q"), "reshape_activations"),
    (dict(d_sae=0), "d_sae"),
    (dict(dtype="int8"), "dtype"),
    (dict(dtype=32), "dtype"),
    (dict(metadata={"hook_name": 3, "sae_lens_version": "6.54.12"}), "metadata.hook_name"),
    (dict(metadata=[1]), "'metadata' must be an object"),
    (dict(architecture="topk", k=99), r"SAEConfig\.k"),
    (dict(architecture="transcoder", d_out=16, apply_b_dec_to_input=True), "apply_b_dec_to_input"),
])
def test_configs_we_cannot_honour_name_the_field(sae_dir, changes, field):
    edit_config(sae_dir, **changes)
    with pytest.raises(wb.ConfigError, match=field):
        wb.load_sae(sae_dir)


def test_missing_fields_and_old_activations(sae_dir):
    cfg = json.loads((sae_dir / "cfg.json").read_text())
    del cfg["d_in"]
    (sae_dir / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(wb.ConfigError, match="no 'd_in' field"):
        wb.load_sae(sae_dir)
    old = dict(d_in=16, d_sae=32, hook_point="blocks.0.hook_resid_pre", activation_fn_str="tanh-relu")
    (sae_dir / "cfg.json").write_text(json.dumps(old))
    with pytest.raises(wb.ConfigError, match="'activation_fn' must be 'relu' or 'topk', got 'tanh-relu'"):
        wb.load_sae(sae_dir)
    (sae_dir / "cfg.json").write_text(json.dumps({**old, "activation_fn_str": "topk"}))
    with pytest.raises(wb.ConfigError, match="activation_fn_kwargs"):
        wb.load_sae(sae_dir)


def test_files_outside_the_directory_are_refused(sae_dir, tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text((sae_dir / "cfg.json").read_text())
    (sae_dir / "cfg.json").unlink()
    (sae_dir / "cfg.json").symlink_to(outside)
    with pytest.raises(wb.CheckpointError, match="resolves outside the SAE directory"):
        wb.load_sae(sae_dir)


def test_a_scaling_factor_of_ones_is_dropped_and_another_refused(tmp_path):
    folder = tmp_path / "old"
    shutil.copytree(FIXTURES / "pre6_standard", folder)
    edit_weights(folder, lambda t: t.update(scaling_factor=torch.ones(32)))
    assert wb.load_sae(folder).cfg.architecture() == "standard"
    edit_weights(folder, lambda t: t.update(scaling_factor=torch.full((32,), 2.0)))
    with pytest.raises(wb.CheckpointError, match="scaling_factor"):
        wb.load_sae(folder)


def test_save_refuses_a_file_path(tmp_path):
    sae = wb.load_sae(FIXTURES / "standard")
    (tmp_path / "file").write_text("x")
    with pytest.raises(wb.CheckpointError, match="not a directory"):
        sae.save(tmp_path / "file")


def test_from_tensors_checks_like_load(tmp_path):
    sae = wb.load_sae(FIXTURES / "skip_transcoder")
    tensors = {name: p.detach().clone() for name, p in sae.named_parameters()}
    built = wb.SAE.from_tensors(sae.cfg, tensors)
    assert all(torch.equal(built.state_dict()[n], t) for n, t in tensors.items())
    with pytest.raises(wb.InputError, match=r"tensor 'W_skip' has shape \(16, 12\), expected \[d_out, d_in\] = \(12, 16\)"):
        wb.SAE.from_tensors(sae.cfg, {**tensors, "W_skip": torch.zeros(16, 12)})
