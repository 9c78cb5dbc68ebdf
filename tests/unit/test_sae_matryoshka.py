"""Matryoshka batch-top-k training (``architecture="matryoshka_batchtopk"``): its training-step loss terms equal
SAELens 6.54.12's ``MatryoshkaBatchTopKTrainingSAE`` on the same weights and batch
(``tests/fixtures/sae_train/matryoshka_losses.pt``, from ``make_matryoshka_losses.py`` in the reference venv);
with the whole SAE's aux-k loss and with SAELens's ``use_matryoshka_aux_loss`` (one per level; its gradients too);
trained (also from the CLI), it is saved for inference as ``jumprelu`` as SAELens saves it; bad levels, and the
per-level aux loss on another architecture, are a clear error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import workbench as wb
from experiments.cli.sae import main
from experiments.sae import train_sae
from experiments.sae.clt import train_clt
from experiments.sae.modules import TrainingSAE
from workbench.errors import InputError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sae_train" / "matryoshka_losses.pt"
# SAELens's names for our terms
SAELENS_NAMES = {"mse_loss": "mse_loss", "aux_loss": "auxiliary_reconstruction_loss"}


def saelens_case(case: str, **options):
    """The fixture's case and our training SAE on its weights, with SAELens's options for it (and ``options``)."""
    saved = torch.load(FIXTURE, weights_only=True)
    data = saved["cases"][case]
    w = data["weights"]
    options = {"k": saved["k"], "matryoshka_widths": tuple(saved["widths"]),
               "aux_loss_coefficient": saved["aux_loss_coefficient"], "topk_threshold_lr": 0.01,
               "use_matryoshka_aux_loss": data.get("use_matryoshka_aux_loss", False), **options}
    sae = TrainingSAE("matryoshka_batchtopk", w["W_enc"].shape[0], w["W_enc"].shape[1], options=options)
    with torch.no_grad():
        for name, value in w.items():
            getattr(sae.sae, name).copy_(value)
    return data, sae


# the whole SAE's aux-k loss (SAELens's default), then use_matryoshka_aux_loss=True: dead features in levels 1 and
# 3, in levels 2 (more than k_aux) and 3 only, and none dead
@pytest.mark.parametrize("case", ["some_dead", "none_dead", "matryoshka_aux_some_dead", "matryoshka_aux_levels",
                                  "matryoshka_aux_none_dead"])
def test_training_step_losses_match_saelens(case):
    data, sae = saelens_case(case)
    out = sae.training_forward(data["x"], data["x"], data["dead"])
    ours = {SAELENS_NAMES.get(name, name): float(value) for name, value in out["losses"].items()}
    assert sorted(ours) == sorted(data["losses"])
    for name, value in data["losses"].items():
        assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name
    assert float(out["loss"]) == pytest.approx(data["loss"], rel=1e-5)
    torch.testing.assert_close(out["feature_acts"], data["feature_acts"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["sae_out"], data["sae_out"], rtol=1e-5, atol=1e-5)
    assert float(sae.topk_threshold) == pytest.approx(data["topk_threshold"], rel=1e-6)


@pytest.mark.parametrize("case", ["matryoshka_aux_some_dead", "matryoshka_aux_levels", "matryoshka_aux_none_dead"])
def test_matryoshka_aux_loss_gradients_match_saelens(case):
    data, sae = saelens_case(case)
    aux = sae.training_forward(data["x"], data["x"], data["dead"])["losses"]["aux_loss"]
    if aux.requires_grad:  # with no dead feature it is a constant 0, as SAELens's
        aux.backward()
    for name, expected in data["aux_grads"].items():
        grad = getattr(sae.sae, name).grad
        torch.testing.assert_close(torch.zeros_like(expected) if grad is None else grad, expected, rtol=1e-5, atol=1e-5)


def test_matryoshka_aux_loss_is_not_the_whole_saes():
    # the option is live: on the same step the whole SAE's aux-k loss is another number than SAELens's per-level one
    data, sae = saelens_case("matryoshka_aux_some_dead", use_matryoshka_aux_loss=False)
    whole = float(sae.training_forward(data["x"], data["x"], data["dead"])["losses"]["aux_loss"])
    assert abs(whole - data["losses"]["auxiliary_reconstruction_loss"]) > 1.0


def test_matryoshka_aux_loss_trains_through_the_cli(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("The cat sat on the mat. " * 300)
    main(["train", "--model", "toy-attn-2l", "--hook", "blocks.0.hook_resid_post", "--data", str(text),
          "--out", str(tmp_path / "m"), "--architecture", "matryoshka_batchtopk", "--d-sae", "32", "--k", "4",
          "--matryoshka-widths", "8,16", "--use-matryoshka-aux-loss", "--dead-feature-window", "1",
          "--training-tokens", "512", "--batch-tokens", "128", "--buffer-tokens", "256", "--no-progress"])
    loaded = wb.load_sae(tmp_path / "m")
    assert loaded.cfg.architecture() == "jumprelu" and loaded.cfg.d_sae == 32


@pytest.mark.parametrize("architecture, value, named", [
    ("batchtopk", True, "use_matryoshka_aux_loss=True is for architecture='matryoshka_batchtopk' only"),
    ("topk", True, "use_matryoshka_aux_loss=True is for"),
    ("matryoshka_batchtopk", "yes", "use_matryoshka_aux_loss must be True or False"),
])
def test_matryoshka_aux_loss_elsewhere_is_a_clear_error(architecture, value, named):
    torch.manual_seed(0)
    model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=64, n_ctx=32)).eval()
    with pytest.raises(InputError, match=re.escape(named)):
        train_sae(model, "blocks.0.hook_resid_post", torch.randint(1, 64, (8, 16)), architecture, d_sae=32, k=4,
                  matryoshka_widths=(8,), use_matryoshka_aux_loss=value, progress=False, training_tokens=512,
                  train_batch_size_tokens=128)


def test_matryoshka_aux_loss_on_a_cross_layer_transcoder_is_a_clear_error():
    model = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=50, n_ctx=16))
    with pytest.raises(InputError, match="use_matryoshka_aux_loss=True is for"):
        train_clt(model, torch.randint(1, 50, (8, 16)), d_transcoder=16, use_matryoshka_aux_loss=True, progress=False,
                  training_tokens=256, train_batch_size_tokens=64, buffer_tokens=128)


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
