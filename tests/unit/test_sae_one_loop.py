"""``train_sae``, ``train_saes`` and ``train_clt`` run one training loop: a lone SAE (and a cross-layer transcoder)
ends as it did before the loops were one (``tests/fixtures/sae_train/solo_results.pt``, saved by
``make_solo_fixture.py`` from the code of that time), its checkpoints keep their layout, and a lone SAE from
``train_saes`` equals ``train_sae``'s.

Against the saved fixture, numbers agree within float32 rounding, not bit for bit: the fixture was written on another
CPU, and a different vector unit rounds the same sums differently (seen: 1.5e-7 relative on an AMD EPYC against an
Intel fixture). Names, shapes, steps and layouts are compared exactly; within one process (the last test) results
are bit-equal."""

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


# float32 rounding on another CPU, compounded over a dozen Adam steps; far below any change a code edit makes
RTOL, ATOL = 1e-5, 1e-6


def _assert_same(found, saved, where):
    """``found`` equals ``saved`` in structure exactly and in every float within RTOL/ATOL."""
    if isinstance(saved, torch.Tensor):
        assert found.shape == saved.shape and found.dtype == saved.dtype, where
        torch.testing.assert_close(found, saved, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where}: {m}")
    elif isinstance(saved, dict):
        assert sorted(found) == sorted(saved), where
        for key in saved:
            _assert_same(found[key], saved[key], f"{where}.{key}")
    elif isinstance(saved, (list, tuple)):
        assert type(found) is type(saved) and len(found) == len(saved), where
        for index, (a, b) in enumerate(zip(found, saved)):
            _assert_same(a, b, f"{where}[{index}]")
    elif isinstance(saved, float):
        assert found == pytest.approx(saved, rel=RTOL, abs=ATOL), where
    else:
        assert found == saved, where


def test_lone_saes_and_the_clt_train_as_before(expected, maker):
    results = maker.train_all()
    assert sorted(results) == sorted(name for name in expected if name != "checkpoint")
    for name, result in results.items():
        _assert_same(result["state"], expected[name]["state"], f"{name}.state")
        _assert_same(result["log"], expected[name]["log"], f"{name}.log")


def test_a_lone_saes_checkpoint_keeps_its_layout(expected, maker, tmp_path):
    model, tokens = maker.model_and_tokens()
    hook, kwargs = maker.CASES["skip_transcoder"]
    train_sae(model, hook, tokens, checkpoint_dir=tmp_path, checkpoint_every=6, **{**maker.FAST, **kwargs})
    _assert_same(maker.checkpoint_layout(tmp_path / "step-6"), expected["checkpoint"], "checkpoint")


def test_one_spec_through_train_saes_equals_train_sae(maker):
    model, tokens = maker.model_and_tokens()
    hook, kwargs = maker.CASES["topk"]
    alone = train_sae(model, hook, tokens, **{**maker.FAST, **kwargs})
    (together,) = train_saes(model, [{"hook_name": hook, "architecture": "topk", "d_sae": 48, "k": 4}], tokens,
                             **maker.FAST)
    for key, tensor in alone.state_dict().items():
        assert torch.equal(tensor, together.state_dict()[key]), key
    assert alone.training_log.equals(together.training_log)
