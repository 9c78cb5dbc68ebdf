"""``wb.load_sae`` reproduces SAELens 6.54.12 on every architecture it saves (fixtures written by SAELens itself:
``tests/fixtures/sae/make_sae_fixtures.py``), and ``sae.save`` round-trips exactly."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sae"
CASES = sorted(path.parent.name for path in FIXTURES.glob("*/expected.safetensors"))
ARCHITECTURES_COVERED = {"standard", "gated", "jumprelu", "topk", "transcoder", "skip_transcoder",
                         "jumprelu_transcoder", "jumprelu_skip_transcoder"}


def outputs(sae: wb.SAE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        features = sae.encode(x)
        out = {"encode": features, "decode": sae.decode(features), "forward": sae(x)}
        if not sae.cfg.is_transcoder:
            sae.use_error_term = True
            out["forward_with_error"] = sae(x)
            sae.use_error_term = False
    return out


def test_the_fixtures_cover_every_architecture_and_the_older_forms():
    assert len(CASES) == 17
    assert {wb.load_sae(FIXTURES / case).cfg.architecture() for case in CASES} == ARCHITECTURES_COVERED
    assert {"batchtopk_as_jumprelu", "pre6_standard", "pre6_topk", "standard_hook_z", "standard_layer_norm",
            "standard_constant_norm_rescale", "standard_expected_average_only_in", "topk_rescale"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_load_sae_matches_saelens(case):
    expected = load_file(str(FIXTURES / case / "expected.safetensors"))
    sae = wb.load_sae(FIXTURES / case)
    ours = outputs(sae, expected["x"])
    assert set(ours) == set(expected) - {"x"}
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=0, msg=f"{case}: {name}")
    assert (expected["encode"] != 0).any() and (expected["encode"] == 0).any()  # features both on and off


@pytest.mark.parametrize("case", CASES)
def test_save_round_trips_identically(case, tmp_path):
    sae = wb.load_sae(FIXTURES / case)
    again = wb.load_sae(sae.save(tmp_path / "copy"))
    saved, original = again.cfg.to_dict(), sae.cfg.to_dict()
    assert saved.pop("metadata").items() >= original.pop("metadata").items()  # plus sae_lens_version for a pre-6.0
    assert saved == original
    for name, tensor in sae.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    x = load_file(str(FIXTURES / case / "expected.safetensors"))["x"]
    for name, tensor in outputs(sae, x).items():
        assert torch.equal(outputs(again, x)[name], tensor), name


def test_pre_6_configs_read_their_top_level_metadata():
    old = wb.load_sae(FIXTURES / "pre6_standard")
    assert old.cfg.hook_name == "blocks.0.hook_resid_pre" and old.cfg.metadata.context_size == 128
    topk = wb.load_sae(FIXTURES / "pre6_topk")
    assert topk.cfg.architecture() == "topk" and topk.cfg.k == 5


def test_dtype_and_device_arguments():
    sae = wb.load_sae(FIXTURES / "jumprelu", dtype=torch.float64, device="cpu")
    assert sae.W_enc.dtype == torch.float64 and sae.cfg.dtype == "float64" and sae.device.type == "cpu"
    expected = load_file(str(FIXTURES / "jumprelu" / "expected.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(sae.encode(expected["x"]).float(), expected["encode"], atol=1e-5, rtol=0)
