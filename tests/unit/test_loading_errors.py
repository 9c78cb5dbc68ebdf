"""Bad checkpoints fail loudly: the right error type, naming the file and the tensor or field.

Each case starts from a valid checkpoint (a tiny `transformers` model saved with
``save_pretrained``, a tiny GGUF, or ``model.save()``) and breaks exactly one thing.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from tests.integration.gguf_tiny import tiny_llama, write_gguf
from tests.integration.hf_tiny import build_and_save
from workbench.loading import CheckpointNotFoundError
from workbench.loading.registry import REGISTRY, RegisteredModel


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama")
    build_and_save("llama", directory)
    return directory


@pytest.fixture
def broken(hf_dir, tmp_path) -> Path:
    """A fresh copy of the valid HF directory, to break one thing in."""
    return Path(shutil.copytree(hf_dir, tmp_path / "broken"))


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_tensors(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_the_valid_checkpoint_loads(hf_dir):
    assert wb.load_model(hf_dir).cfg.n_layers == 2


def test_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(CheckpointNotFoundError, match="no-such-model") as info:
        wb.load_model(missing)
    assert isinstance(info.value, wb.CheckpointError) and isinstance(info.value, FileNotFoundError)
    with pytest.raises(FileNotFoundError, match="smollm-typo.*registered"):
        wb.load_model("smollm-typo")


def test_registered_but_not_installed(monkeypatch):
    monkeypatch.setitem(REGISTRY, "ghost-1l", RegisteredModel("ghost-1l", "test entry", lambda: None, "run `make ghost`"))
    with pytest.raises(wb.CheckpointError, match="'ghost-1l' is not installed: run `make ghost`"):
        wb.load_model("ghost-1l")


def test_missing_safetensors_file(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(wb.CheckpointError, match=r"model\.safetensors.*not found"):
        wb.load_model(broken)


def test_truncated_safetensors_file(broken):
    path = broken / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(wb.CheckpointError, match=r"broken/model\.safetensors.*truncated"):
        wb.load_model(broken)


def test_tensor_with_the_wrong_shape(broken):
    edit_tensors(broken, lambda t: t.__setitem__("model.layers.1.self_attn.k_proj.weight", torch.zeros(24, 48)))
    with pytest.raises(wb.CheckpointError,
                       match=r"model\.safetensors: tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \(24, 48\), expected \(16, 48\)"):
        wb.load_model(broken)


def test_missing_tensor(broken):
    edit_tensors(broken, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(wb.CheckpointError, match=r"model\.safetensors: missing tensor 'model\.layers\.0\.mlp\.up_proj\.weight'"):
        wb.load_model(broken)


def test_unexpected_tensor(broken):
    edit_tensors(broken, lambda t: t.__setitem__("model.layers.2.mlp.up_proj.weight", torch.zeros(80, 48)))
    with pytest.raises(wb.CheckpointError, match=r"unexpected tensor.*model\.layers\.2\.mlp\.up_proj\.weight"):
        wb.load_model(broken)


def test_unknown_architecture(broken):
    edit_config(broken, architectures=["NoSuchModelForCausalLM"], model_type="no_such_model")
    with pytest.raises(wb.CheckpointError, match=r"config\.json: unknown architecture \['NoSuchModelForCausalLM'\].*'architectures'"):
        wb.load_model(broken)


@pytest.mark.parametrize("field, value, culprit", [
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}, "rope_parameters.rope_type"),
    ("rope_scaling", {"type": "su", "factor": 2.0}, "rope_scaling.rope_type"),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}, "rotary_scaling"),
    ("hidden_act", "mish", "hidden_act"),
    ("num_key_value_heads", 4, "n_key_value_heads"),
])
def test_config_value_we_cannot_honour(broken, field, value, culprit):
    edit_config(broken, **{field: value})
    with pytest.raises(wb.ConfigError, match=rf"config\.json: .*{culprit.replace('.', '[.]')}"):
        wb.load_model(broken)


def test_unreadable_config(broken):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(wb.CheckpointError, match=r"config\.json: unreadable config"):
        wb.load_model(broken)


def test_missing_shard(tmp_path):
    model = build_and_save("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(wb.CheckpointError, match=rf"{shard.name}: shard file not found.*tensor 'model\."):
        wb.load_model(tmp_path)


class _TouchOnUnpickle:
    """Unpickling this creates a file: proof that something ran code from the checkpoint."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (open, (str(self.sentinel), "w"))


def test_pickled_weights_are_never_unpickled(broken, tmp_path):
    sentinel = tmp_path / "code-from-the-checkpoint-ran"
    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(pickle.dumps(_TouchOnUnpickle(sentinel)))
    with pytest.raises(wb.CheckpointError, match=r"pytorch_model\.bin: only pickled weights.*never unpickle"):
        wb.load_model(broken)
    assert not sentinel.exists()


# ---- GGUF ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_gguf(tiny_llama(), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_the_valid_gguf_loads(tiny_gguf):
    assert wb.load_model(tiny_gguf).cfg.n_key_value_heads == 2


@pytest.mark.parametrize("damage", ["bad magic", "truncated header"])
def test_corrupt_gguf_header(tiny_gguf, tmp_path, damage):
    data = tiny_gguf.read_bytes()
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUX" + data[4:] if damage == "bad magic" else data[:200])
    with pytest.raises(wb.CheckpointError, match=r"corrupt\.gguf: not a readable GGUF file"):
        wb.load_model(path)


def test_gguf_missing_tensor(tmp_path):
    path = write_gguf(tiny_llama(), tmp_path / "holed.gguf", skip_tensor="blk.1.ffn_up.weight")
    with pytest.raises(wb.CheckpointError, match=r"holed\.gguf: missing tensor.*blk\.1\.ffn_up\.weight"):
        wb.load_model(path)


def test_gguf_rope_scaling_we_cannot_honour(tmp_path):
    path = write_gguf(tiny_llama(), tmp_path / "yarn.gguf", extra_fields={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(wb.ConfigError, match=r"yarn\.gguf: field 'llama\.rope\.scaling\.type' = 'yarn'"):
        wb.load_model(path)


def test_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(wb.CheckpointError, match=r"weights\.safetensors: a file must be a \.gguf"):
        wb.load_model(path)


# ---- our own format ----------------------------------------------------------------------------


@pytest.fixture
def native_dir(tmp_path) -> Path:
    model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=20, n_ctx=8))
    return model.save(tmp_path / "native")


def test_native_truncated_weights(native_dir):
    path = native_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(wb.CheckpointError, match=r"native/model\.safetensors: unreadable or truncated"):
        wb.load_model(native_dir)


def test_native_wrong_shape(native_dir):
    edit_tensors(native_dir, lambda t: t.__setitem__("blocks.0.attn._W_Q_lin", torch.zeros(16, 17)))
    with pytest.raises(wb.CheckpointError, match=r"model\.safetensors: tensor 'blocks\.0\.attn\._W_Q_lin' has shape \(16, 17\)"):
        wb.load_model(native_dir)


def test_native_missing_tensor(native_dir):
    edit_tensors(native_dir, lambda t: t.pop("blocks.0.mlp._W_out_lin"))
    with pytest.raises(wb.CheckpointError, match=r"model\.safetensors: missing tensor.*blocks\.0\.mlp\._W_out_lin"):
        wb.load_model(native_dir)


def test_native_bad_config_field(native_dir):
    edit_config(native_dir, positional="spiral")
    with pytest.raises(wb.CheckpointError, match=r"config\.json: .*positional"):
        wb.load_model(native_dir)


def test_a_directory_without_config(tmp_path):
    with pytest.raises(wb.CheckpointError, match=r"config\.json: not found"):
        wb.load_model(tmp_path)


def test_gguf_tensor_with_the_wrong_shape(tmp_path):
    import gguf
    import numpy as np

    # Rewrite one tensor of the tiny file with one row too few (same dtype, valid layout).
    source = tmp_path / "good.gguf"
    write_gguf(tiny_llama(), source, quant=gguf.GGMLQuantizationType.F16)
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(tmp_path / "misshapen.gguf"), "llama")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        writer.add_tensor(tensor.name, data[:-1] if tensor.name == "blk.0.attn_v.weight" else data,
                          raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(wb.CheckpointError, match=r"misshapen\.gguf: tensor 'blk\.0\.attn_v\.weight' has shape \(31, 64\)"):
        wb.load_model(tmp_path / "misshapen.gguf")
