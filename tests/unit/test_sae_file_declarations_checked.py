"""An SAE directory is judged by what it declares before anything it holds is read: the safetensors header's
names, shapes and dtypes are checked against cfg.json before any tensor is loaded, and every malformed config
value is a ``ConfigError`` / ``CheckpointError`` naming the file and the field, never a raw Python error."""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
import workbench.sae.files as sae_files
from tests.unit.tensor_reads import count_tensor_reads

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sae"


@pytest.fixture
def sae_dir(tmp_path):
    target = tmp_path / "sae"
    shutil.copytree(FIXTURES / "jumprelu", target)
    return target


@pytest.fixture
def tensor_reads(monkeypatch):
    """Counts the tensors ``load_sae`` reads from a safetensors file (the header alone is not a read)."""
    return count_tensor_reads(monkeypatch, sae_files)


def edit_config(folder: Path, edit):
    cfg = json.loads((folder / "cfg.json").read_text())
    edit(cfg)
    (folder / "cfg.json").write_text(json.dumps(cfg))


def edit_weights(folder: Path, change):
    tensors = load_file(str(folder / "sae_weights.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "sae_weights.safetensors"))


def test_an_untampered_directory_reads_each_tensor_once(sae_dir, tensor_reads):
    sae = wb.load_sae(sae_dir)
    assert sorted(tensor_reads) == sorted(name for name, _ in sae.named_parameters())


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update(W_enc=torch.zeros(16)), r"tensor 'W_enc' has shape \(16,\), expected \[d_in, d_sae\] = \(16, 32\)"),
    (lambda t: t.update(extra=torch.zeros(3)), "unexpected 'extra'"),
    (lambda t: t.update(W_dec=torch.zeros(64, 16)), r"tensor 'W_dec' has shape \(64, 16\), expected \[d_sae, d_in\]"),
    (lambda t: t.update(b_enc=torch.zeros(32, dtype=torch.int32)), "tensor 'b_enc' must be a floating-point tensor, got I32"),
    (lambda t: t.update(scaling_factor=torch.ones(4096)), r"tensor 'scaling_factor' has shape \(4096,\), expected \[d_sae\]"),
])
def test_a_file_declaring_wrong_tensors_is_refused_before_any_tensor_is_read(sae_dir, tensor_reads, change, message):
    edit_weights(sae_dir, change)
    with pytest.raises(wb.CheckpointError, match=rf"sae_weights\.safetensors: .*{message}"):
        wb.load_sae(sae_dir)
    assert tensor_reads == []


def test_a_two_gib_extra_tensor_is_refused_from_the_header_without_allocating(sae_dir, tensor_reads):
    """The extra tensor's bytes are a sparse hole: the file declares 2 GiB it would cost memory to read."""
    weights = sae_dir / "sae_weights.safetensors"
    raw = weights.read_bytes()
    header_length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + header_length])
    data = raw[8 + header_length:]
    huge = 2**31
    header["huge"] = {"dtype": "F32", "shape": [huge // 4], "data_offsets": [len(data), len(data) + huge]}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with weights.open("wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded + data)
        file.truncate(8 + len(encoded) + len(data) + huge)
    with pytest.raises(wb.CheckpointError, match="unexpected 'huge'"):
        wb.load_sae(sae_dir)
    assert tensor_reads == []


@pytest.mark.parametrize("edit, field", [
    (lambda c: c["metadata"].update(hook_head_index="0"), r"metadata\.hook_head_index .*got '0'"),
    (lambda c: c["metadata"].update(hook_head_index=-1), r"metadata\.hook_head_index .*got -1"),
    (lambda c: c["metadata"].update(hook_head_index_out=True), r"metadata\.hook_head_index_out .*got True"),
    (lambda c: c.update(d_in="16"), r"d_in must be a positive integer, got '16'"),
    (lambda c: c.update(d_sae=[32]), r"d_sae must be a positive integer, got \[32\]"),
    (lambda c: c.update(d_sae=32.0), r"d_sae must be a positive integer, got 32\.0"),
    (lambda c: c.update(d_sae=float("nan")), r"d_sae must be a positive integer, got nan"),
    (lambda c: c.update(d_in=float("inf")), r"d_in must be a positive integer, got inf"),
    (lambda c: c.pop("d_sae"), r"no 'd_sae' field"),
    (lambda c: c.pop("architecture"), r"no 'architecture' field"),
    (lambda c: c.update(architecture=["jumprelu"]), r"'architecture'"),
])
def test_a_malformed_config_value_names_the_file_and_the_field(sae_dir, tensor_reads, edit, field):
    edit_config(sae_dir, edit)
    with pytest.raises(wb.ConfigError, match=rf"cfg\.json: .*{field}"):
        wb.load_sae(sae_dir)
    assert tensor_reads == []


def test_a_head_index_that_is_an_integer_still_loads(sae_dir):
    edit_config(sae_dir, lambda c: c["metadata"].update(hook_head_index=0))
    assert wb.load_sae(sae_dir).cfg.metadata.hook_head_index == 0


def test_a_config_nested_100k_deep_is_a_checkpoint_error_not_a_recursion_error(sae_dir):
    (sae_dir / "cfg.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(wb.CheckpointError, match=r"cfg\.json: not a readable JSON file \(nested too deeply"):
        wb.load_sae(sae_dir)


def test_a_config_nested_deeper_than_the_cap_names_the_field(sae_dir):
    """Deep enough to parse, but deeper than any SAELens config: refused before anything copies it recursively."""
    edit_config(sae_dir, lambda c: c["metadata"].update(extra=json.loads("[" * 900 + "]" * 900)))
    with pytest.raises(wb.ConfigError, match=r"cfg\.json: SAE config field 'metadata\.extra\[0\].*nests deeper"):
        wb.load_sae(sae_dir)


@pytest.mark.parametrize("old, field", [
    (dict(hook_point=3), r"'hook_point' \(hook_name\) must be a hook point name, got 3"),
    (dict(hook_point="blocks.0.hook_resid_pre", activation_fn_str="topk", activation_fn_kwargs=[3]),
     r"'activation_fn_kwargs' must be an object, got \[3\]"),
])
def test_a_malformed_pre_6_config_names_the_field(tmp_path, old, field):
    folder = tmp_path / "old"
    shutil.copytree(FIXTURES / "pre6_standard", folder)
    (folder / "cfg.json").write_text(json.dumps(dict(d_in=16, d_sae=32, **old)))
    with pytest.raises(wb.ConfigError, match=field):
        wb.load_sae(folder)


def test_an_oversized_config_file_is_refused_unread(sae_dir, monkeypatch):
    monkeypatch.setattr(sae_files, "MAX_CONFIG_BYTES", 64)
    with pytest.raises(wb.CheckpointError, match=r"cfg\.json: \d+ bytes, more than an SAE config's 64"):
        wb.load_sae(sae_dir)


def test_a_weights_file_linked_from_outside_the_directory_is_refused(sae_dir, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(sae_dir / "sae_weights.safetensors", outside)
    (sae_dir / "sae_weights.safetensors").symlink_to(outside)
    with pytest.raises(wb.CheckpointError, match="resolves outside the SAE directory"):
        wb.load_sae(sae_dir)
