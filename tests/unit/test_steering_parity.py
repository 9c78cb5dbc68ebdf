"""Steering vectors against the reference libraries on the same tiny HF Llama checkpoint
(``tests/fixtures/steering/make_fixtures.py``): CAA equals steering-vectors 0.12.2's ``train_steering_vector``,
PCA reading vectors equal repeng 0.4.0's up to sign, our control-vector GGUF reads in repeng as what we wrote, and
repeng's GGUF reads in ours."""

import json
from pathlib import Path

import pytest
import torch

import workbench as wb
from experiments.steering import SteeringVector, train_steering_vector

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "steering"
pytestmark = pytest.mark.skipif(not (FIXTURES / "expected.json").is_file(), reason="fixtures not generated")


@pytest.fixture(scope="module")
def expected():
    return json.loads((FIXTURES / "expected.json").read_text())


@pytest.fixture(scope="module")
def tiny_llama():
    return wb.load_model(FIXTURES / "tiny_llama", progress=False).eval()


@pytest.mark.parametrize("read_token_index", [-1, -2])
def test_caa_equals_steering_vectors(tiny_llama, expected, read_token_index):
    pairs = [tuple(pair) for pair in expected["token_ids"]]   # the ids the reference tokenizer gave each prompt
    vector = train_steering_vector(tiny_llama, pairs, layers=None, read_token_index=read_token_index, method="caa")
    reference = expected["caa"][str(read_token_index)]
    assert sorted(vector.layer_activations) == sorted(int(layer) for layer in reference)
    for layer, values in reference.items():
        torch.testing.assert_close(vector.layer_activations[int(layer)], torch.tensor(values), atol=1e-5, rtol=0)


def test_pca_reading_vectors_equal_repengs_up_to_sign(tiny_llama, expected):
    pairs = [tuple(pair) for pair in expected["token_ids"]]
    vector = train_steering_vector(tiny_llama, pairs, layers=expected["pca_layers"], method="pca")
    for layer, values in expected["pca"].items():
        ours, theirs = vector.layer_activations[int(layer)], torch.tensor(values)
        sign = torch.sign(ours @ theirs)
        torch.testing.assert_close(sign * ours, theirs, atol=1e-4, rtol=0)


def test_our_control_vector_gguf_loads_in_repeng_as_written(expected, tmp_path):
    written = {int(layer): torch.tensor(values) for layer, values in expected["ours_gguf_vector"].items()}
    path = SteeringVector(written).export_gguf(tmp_path / "ours.gguf", model_hint="llama")
    assert path.read_bytes() == (FIXTURES / "ours.gguf").read_bytes()   # the file repeng read is what we write today
    read = expected["repeng_read_ours"]
    assert read["model_type"] == "llama"
    assert sorted(int(layer) for layer in read["directions"]) == sorted(written)
    for layer, values in read["directions"].items():
        assert torch.equal(torch.tensor(values), written[int(layer)])


def test_repengs_control_vector_gguf_imports(expected):
    vector = SteeringVector.import_gguf(FIXTURES / "repeng.gguf")
    assert vector.meta["model_hint"] == "llama"
    assert sorted(vector.layer_activations) == sorted(int(layer) for layer in expected["pca"])
    for layer, values in expected["pca"].items():
        assert torch.equal(vector.layer_activations[int(layer)], torch.tensor(values))
