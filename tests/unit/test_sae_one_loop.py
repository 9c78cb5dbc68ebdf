"""``train_sae``, ``train_saes`` and ``train_clt`` run one training loop: a lone SAE (and a cross-layer transcoder)
ends exactly as it did before the loops were one (``tests/fixtures/sae_train/solo_results.pt``, saved by
``make_solo_fixture.py`` from the code of that time), its checkpoints keep their layout, and a lone SAE from
``train_saes`` equals ``train_sae``'s."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from experiments.sae import train_sae, train_saes

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sae_train"


def _maker():
    spec = importlib.util.spec_from_file_location("make_solo_fixture", FIXTURES / "make_solo_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def expected():
    return torch.load(FIXTURES / "solo_results.pt", weights_only=False)


@pytest.fixture(scope="module")
def maker():
    return _maker()


def test_lone_saes_and_the_clt_train_exactly_as_before(expected, maker):
    results = maker.train_all()
    for name, result in results.items():
        saved = expected[name]
        assert sorted(result["state"]) == sorted(saved["state"]), name
        for key, tensor in result["state"].items():
            assert torch.equal(tensor, saved["state"][key]), (name, key)
        assert result["log"] == saved["log"], name


def test_a_lone_saes_checkpoint_keeps_its_layout(expected, maker, tmp_path):
    model, tokens = maker.model_and_tokens()
    hook, kwargs = maker.CASES["skip_transcoder"]
    train_sae(model, hook, tokens, checkpoint_dir=tmp_path, checkpoint_every=6, **{**maker.FAST, **kwargs})
    assert maker.checkpoint_layout(tmp_path / "step-6") == expected["checkpoint"]


def test_one_spec_through_train_saes_equals_train_sae(maker):
    model, tokens = maker.model_and_tokens()
    hook, kwargs = maker.CASES["topk"]
    alone = train_sae(model, hook, tokens, **{**maker.FAST, **kwargs})
    (together,) = train_saes(model, [{"hook_name": hook, "architecture": "topk", "d_sae": 48, "k": 4}], tokens,
                             **maker.FAST)
    for key, tensor in alone.state_dict().items():
        assert torch.equal(tensor, together.state_dict()[key]), key
    assert alone.training_log.equals(together.training_log)
