"""SAELens 6.54's abs-top-k and matching-pursuit SAEs, Matryoshka batch-top-k's inference save (a JumpReLU SAE)
and the batch-top-k and Matryoshka training checkpoints, read by ``wb.load_sae`` from folders SAELens wrote.

Expected values: SAELens 6.54.12 itself (tests/fixtures/sae/make_more_architectures.py: each case's ``save_model``
folder and ``expected_outputs.safetensors``, SAELens's ``encode``, ``decode``, ``forward`` and ``forward`` with the
error term of a fixed [2, 5, 16] input; for a training checkpoint, those of the JumpReLU SAE SAELens's
``save_inference_model`` makes of it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from workbench.sae.config import config_from_dict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sae"
OUTPUTS = "expected_outputs.safetensors"
CASES = sorted(path.parent.name for path in FIXTURES.glob(f"*/{OUTPUTS}"))


def test_cases_cover_each_architecture_and_its_fields():
    architectures = {json.loads((FIXTURES / case / "cfg.json").read_text())["architecture"] for case in CASES}
    assert architectures == {"abstopk", "matching_pursuit", "jumprelu", "batchtopk", "matryoshka_batchtopk"}
    assert {"abstopk", "abstopk_rescale", "matching_pursuit", "matching_pursuit_capped",
            "matryoshka_batchtopk_inference", "batchtopk_checkpoint", "matryoshka_batchtopk_checkpoint"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_encode_decode_and_forward_match_saelens(case):
    expected = load_file(str(FIXTURES / case / OUTPUTS))
    sae = wb.load_sae(FIXTURES / case)
    x = expected["x"]
    with torch.no_grad():
        features = sae.encode(x)
        torch.testing.assert_close(features, expected["encode"], atol=1e-5, rtol=0)
        torch.testing.assert_close(sae.decode(features), expected["decode"], atol=1e-5, rtol=0)
        torch.testing.assert_close(sae(x), expected["forward"], atol=1e-5, rtol=0)
        sae.use_error_term = True
        torch.testing.assert_close(sae(x), expected["forward_with_error"], atol=1e-5, rtol=0)
    assert (expected["encode"] != 0).any()


def test_abstopk_keeps_negative_activations_and_exactly_k_per_row():
    expected = load_file(str(FIXTURES / "abstopk" / OUTPUTS))["encode"]
    assert (expected < 0).any()  # signed: SAELens's features fire negative too
    features = wb.load_sae(FIXTURES / "abstopk").encode(load_file(str(FIXTURES / "abstopk" / OUTPUTS))["x"])
    assert ((features != 0).sum(-1) == 4).all() and (features < 0).any()


def test_matching_pursuit_is_tied_and_stores_only_the_decoder():
    sae = wb.load_sae(FIXTURES / "matching_pursuit")
    assert {name for name, _ in sae.named_parameters()} == {"W_dec", "b_dec"}
    capped = wb.load_sae(FIXTURES / "matching_pursuit_capped").cfg
    assert (capped.max_iterations, capped.residual_threshold, capped.stop_on_duplicate_support) == (3, 0.5, False)
    assert capped.to_dict()["max_iterations"] == 3 and "k" not in capped.to_dict()


def test_a_training_checkpoint_reads_its_threshold_and_rescaling_and_drops_the_training_fields():
    sae = wb.load_sae(FIXTURES / "matryoshka_batchtopk_checkpoint")
    raw = json.loads((FIXTURES / "matryoshka_batchtopk_checkpoint" / "cfg.json").read_text())
    assert raw["rescale_acts_by_decoder_norm"] is True and sae.cfg.rescale_acts_by_decoder_norm is True
    assert float(sae.topk_threshold.detach()) == pytest.approx(0.3) and sae.topk_threshold.shape == ()
    assert not {"k", "matryoshka_widths", "aux_loss_coefficient"} & set(sae.cfg.to_dict())
    assert wb.load_sae(FIXTURES / "batchtopk_checkpoint").cfg.rescale_acts_by_decoder_norm is False


@pytest.mark.parametrize("case", CASES)
def test_saved_again_the_sae_reads_back_the_same(case, tmp_path):
    sae = wb.load_sae(FIXTURES / case)
    again = wb.load_sae(sae.save(tmp_path / case))
    x = load_file(str(FIXTURES / case / OUTPUTS))["x"]
    with torch.no_grad():
        torch.testing.assert_close(again(x), sae(x), atol=0, rtol=0)
    assert again.cfg.to_dict() == sae.cfg.to_dict()


@pytest.fixture(scope="module")
def model():
    return wb.load_model("toy-attn-2l", progress=False).eval()


@pytest.mark.parametrize("case", ["abstopk_rescale", "matching_pursuit", "matryoshka_batchtopk_checkpoint"])
def test_spliced_at_a_residual_hook_with_the_error_term_the_logits_are_unchanged(model, case):
    raw = json.loads((FIXTURES / case / "cfg.json").read_text())
    width, hook = model.cfg.d_model, "blocks.1.hook_resid_pre"
    raw.update(d_in=width, metadata={**raw["metadata"], "hook_name": hook})
    cfg = config_from_dict(raw)
    generator = torch.Generator().manual_seed(1)
    shapes = wb.sae.ARCHITECTURES[cfg.architecture()].weight_shapes(width, cfg.d_sae, width, cfg)
    sae = wb.SAE.from_tensors(cfg, {name: torch.randn(shape, generator=generator) * 0.3
                                    for name, shape in shapes.items()})
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 6), generator=generator)
    with torch.no_grad():
        clean = model(tokens)
        torch.testing.assert_close(model.run_with_saes(tokens, saes=[sae], use_error_term=True), clean,
                                   atol=1e-5, rtol=0)
        spliced, cache = model.run_with_cache_with_saes(tokens, saes=[sae])
    assert spliced.shape == clean.shape and not torch.allclose(spliced, clean, atol=1e-4)
    assert cache[f"{hook}.hook_sae_acts_post"].shape == (2, 6, cfg.d_sae)
    assert model.attached_hooks() == {}


@pytest.mark.parametrize(("case", "field", "value"), [
    ("abstopk", "k", 0),
    ("abstopk", "k", 33),
    ("matching_pursuit", "residual_threshold", -0.1),
    ("matching_pursuit", "residual_threshold", "small"),
    ("matching_pursuit", "max_iterations", 0),
    ("matching_pursuit", "stop_on_duplicate_support", "yes"),
])
def test_a_bad_field_value_is_a_config_error_naming_it(case, field, value, tmp_path):
    folder = tmp_path / case
    shutil.copytree(FIXTURES / case, folder)
    raw = json.loads((folder / "cfg.json").read_text())
    raw[field] = value
    (folder / "cfg.json").write_text(json.dumps(raw))
    with pytest.raises(wb.ConfigError, match=field):
        wb.load_sae(folder)
