"""Bad input to steering: clear errors naming what is wrong, and nothing left attached to the model."""

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import workbench as wb
from experiments.steering import SteeringVector, coefficient_sweep, logit_difference, train_steering_vector
from workbench.errors import CheckpointError, InputError


@pytest.fixture(scope="module")
def toy():
    return wb.load_model("toy-attn-2l", progress=False).eval()


def _nothing_attached(model) -> bool:
    return model.attached_hooks() == {} and not any(point._forward_hooks for point in model.hook_dict.values())


@pytest.mark.parametrize("pairs, message", [
    ([("only a positive",)], "both classes"),
    (["just text", "more text"], "both classes"),
    ([], "pairs is empty"),
])
def test_one_class_only_is_refused(toy, pairs, message):
    with pytest.raises(InputError, match=message):
        train_steering_vector(toy, pairs)
    assert _nothing_attached(toy)


def test_pca_needs_two_pairs_and_actadd_exactly_one(toy):
    with pytest.raises(InputError, match="pca needs at least 2 pairs"):
        train_steering_vector(toy, [("A cat", "A dog")], method="pca")
    with pytest.raises(InputError, match="actadd takes exactly one pair"):
        train_steering_vector(toy, [("A cat", "A dog"), ("cat", "dog")], method="actadd")
    with pytest.raises(InputError, match="method must be one of"):
        train_steering_vector(toy, [("A cat", "A dog")], method="svd")
    with pytest.raises(InputError, match="the same, so it has no principal axis"):
        train_steering_vector(toy, [("A cat", "A dog"), ("A cat", "A dog")], method="pca")


def test_a_layer_out_of_range_is_refused_in_training_and_in_applying(toy):
    with pytest.raises(InputError, match="layer 2 is out of range: the model has 2 layers"):
        train_steering_vector(toy, [("A cat", "A dog")], layers=[0, 2])
    vector = SteeringVector({0: torch.ones(128), 5: torch.ones(128)})
    with pytest.raises(InputError, match="layer 5 is out of range"):
        with vector.apply(toy):
            pass
    assert _nothing_attached(toy)


def test_a_read_token_outside_a_prompt_is_refused(toy):
    with pytest.raises(InputError, match="read_token_index 40 is outside a prompt"):
        train_steering_vector(toy, [("A cat", "A dog")], read_token_index=40)
    assert _nothing_attached(toy)


def test_mismatched_d_model_is_refused_before_anything_is_attached(toy):
    vector = SteeringVector({0: torch.ones(64)})
    with pytest.raises(InputError, match="d_model 64 but the model's d_model is 128"):
        with vector.apply(toy, multiplier=1.0):
            pass
    with pytest.raises(InputError, match="d_model 64"):
        coefficient_sweep(toy, vector, "A cat", logit_difference(" on", " the"), [0.0, 1.0])
    with pytest.raises(InputError, match="same d_model"):
        SteeringVector({0: torch.ones(64), 1: torch.ones(128)})
    with pytest.raises(InputError, match="multiplier must be finite"):
        SteeringVector({0: torch.ones(128)}).hooks(toy, multiplier=float("nan"))
    assert _nothing_attached(toy)


def test_an_error_inside_the_block_still_removes_the_vector(toy):
    with pytest.raises(RuntimeError, match="inside"):
        with SteeringVector({1: torch.ones(128)}).apply(toy, 3.0):
            raise RuntimeError("inside")
    assert _nothing_attached(toy)


def _write(folder, tensors, d_model, layers):
    folder.mkdir()
    save_file(tensors, str(folder / "vector.safetensors"))
    (folder / "vector.json").write_text(json.dumps({"format": "workbench-steering-vector", "version": 1,
                                                    "layer_type": "decoder_block", "layers": layers,
                                                    "d_model": d_model, "meta": {}}))
    return folder


@pytest.mark.parametrize("tensors, d_model, layers, message", [
    ({"layer.0": torch.ones(3)}, 4, [0], r"shape \(3,\), expected \[d_model\] = \(4,\)"),
    ({"layer.0": torch.ones(2, 4)}, 4, [0], r"shape \(2, 4\)"),
    ({"layer.0": torch.ones(4, dtype=torch.int64)}, 4, [0], "dtype I64; a steering vector is floating-point"),
    ({"layer.0": torch.ones(4)}, 4, [0, 1], "vector.json lists"),
    ({"layer.0": torch.full((4,), float("nan"))}, 4, [0], "NaN"),
])
def test_a_vector_file_of_the_wrong_shape_or_dtype_is_refused(tmp_path, tensors, d_model, layers, message):
    with pytest.raises(CheckpointError, match=message):
        SteeringVector.load(_write(tmp_path / "bad", tensors, d_model, layers))


def test_a_vector_json_that_is_not_ours_and_a_gguf_of_the_wrong_shape_are_refused(tmp_path):
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "vector.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="not a steering vector's vector.json"):
        SteeringVector.load(folder)
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    writer.add_tensor("direction.1", np.ones((2, 4), dtype=np.float32))
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    with pytest.raises(CheckpointError, match="must be a 1-D float vector"):
        SteeringVector.import_gguf(path)
    other = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(other), "llama")
    writer.add_tensor("direction.1", np.ones(4, dtype=np.float32))
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    with pytest.raises(CheckpointError, match="architecture 'llama' is not a control vector"):
        SteeringVector.import_gguf(other)
