"""Matryoshka batch-top-k training (``architecture="matryoshka_batchtopk"``): its training-step loss terms equal
SAELens 6.54.12's ``MatryoshkaBatchTopKTrainingSAE`` on the same weights and batch
(``tests/fixtures/sae_train/matryoshka_losses.pt``, from ``make_matryoshka_losses.py`` in the reference venv);
trained, it is saved for inference as ``jumprelu`` as SAELens saves it; bad levels are a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from experiments.sae import train_sae
from experiments.sae.modules import TrainingSAE
from workbench.errors import InputError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sae_train" / "matryoshka_losses.pt"
# SAELens's names for our terms
SAELENS_NAMES = {"mse_loss": "mse_loss", "aux_loss": "auxiliary_reconstruction_loss"}


@pytest.mark.parametrize("case", ["some_dead", "none_dead"])
def test_training_step_losses_match_saelens(case):
    saved = torch.load(FIXTURE, weights_only=True)
    data = saved["cases"][case]
    w = data["weights"]
    sae = TrainingSAE("matryoshka_batchtopk", w["W_enc"].shape[0], w["W_enc"].shape[1],
                      options={"k": saved["k"], "matryoshka_widths": tuple(saved["widths"]),
                               "aux_loss_coefficient": saved["aux_loss_coefficient"], "topk_threshold_lr": 0.01})
    with torch.no_grad():
        for name, value in w.items():
            getattr(sae.sae, name).copy_(value)
    out = sae.training_forward(data["x"], data["x"], data["dead"])
    ours = {SAELENS_NAMES.get(name, name): float(value) for name, value in out["losses"].items()}
    assert sorted(ours) == sorted(data["losses"])
    for name, value in data["losses"].items():
        assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name
    assert float(out["loss"]) == pytest.approx(data["loss"], rel=1e-5)
    torch.testing.assert_close(out["feature_acts"], data["feature_acts"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["sae_out"], data["sae_out"], rtol=1e-5, atol=1e-5)
    assert float(sae.topk_threshold) == pytest.approx(data["topk_threshold"], rel=1e-6)


def test_trained_matryoshka_is_saved_as_jumprelu(tmp_path):
    torch.manual_seed(0)
    model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=64, n_ctx=32)).eval()
    tokens = torch.randint(1, 64, (16, 16), generator=torch.Generator().manual_seed(1))
    sae = train_sae(model, "blocks.0.hook_resid_post", tokens, "matryoshka_batchtopk", d_sae=32, k=4,
                    matryoshka_widths=(4, 16), progress=False, training_tokens=512, train_batch_size_tokens=128,
                    buffer_tokens=256, log_every=1, out=tmp_path / "m")
    loaded = wb.load_sae(tmp_path / "m")
    assert loaded.cfg.architecture() == "jumprelu" and torch.equal(loaded.threshold, sae.threshold)
    assert float(sae.threshold[0]) > 0 and (sae.threshold == sae.threshold[0]).all()  # the global threshold


@pytest.mark.parametrize("widths, named", [((), "non-empty"), ((8, 4), "strictly increasing"), ((4, 99), "from 1 to"),
                                           ("4,8", "list of increasing")])
def test_bad_levels_are_a_clear_error(widths, named):
    torch.manual_seed(0)
    model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=64, n_ctx=32)).eval()
    with pytest.raises(InputError, match=named):
        train_sae(model, "blocks.0.hook_resid_post", torch.randint(1, 64, (8, 16)), "matryoshka_batchtopk", d_sae=32,
                  k=4, matryoshka_widths=widths, progress=False, training_tokens=512, train_batch_size_tokens=128)


def test_k_above_d_sae_is_a_clear_error():
    torch.manual_seed(0)
    model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=64, n_ctx=32)).eval()
    with pytest.raises(InputError, match="k must be"):
        train_sae(model, "blocks.0.hook_resid_post", torch.randint(1, 64, (8, 16)), "matryoshka_batchtopk", d_sae=32,
                  k=64, matryoshka_widths=(8,), progress=False, training_tokens=512, train_batch_size_tokens=128)
