"""The temporal SAE architecture and SAELens's ``temporal`` conversion kind (canrager's temporal SAEs), loaded from a
(fake, loopback) Hub by ``wb.load_sae(release, sae_id)``.

Expected values: SAELens 6.54.12's ``TemporalSAE`` itself, through ``SAE.from_pretrained`` on the same files served
by the same fake hub (tests/fixtures/sae_kinds/make_temporal.py: each case's repo files, SAELens's ``encode``,
``encode_with_predictions``, ``decode`` and ``forward`` of a fixed [2, 5, 16] input, and its config).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from tests.hub_server import files_of, hub  # noqa: F401  (the fixture)
from workbench.hub import sae_releases
from workbench.sae.foreign.temporal import temporal_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sae_kinds"
CASES = sorted(path.name for path in FIXTURES.iterdir()
               if path.name.startswith("temporal_") and (path / "expected.json").is_file())
FIELDS = ("architecture", "d_in", "d_sae", "dtype", "apply_b_dec_to_input", "normalize_activations",
          "reshape_activations", "n_heads", "n_attn_layers", "bottleneck_factor", "sae_diff_type", "kval_topk",
          "tied_weights", "activation_normalization_factor")


def _expected(case: str) -> dict:
    return json.loads((FIXTURES / case / "expected.json").read_text())


@pytest.fixture
def temporal_hub(hub, monkeypatch):  # noqa: F811
    """Every case's files in one repo on the fake hub, and its release in a test-only registry."""
    files: dict[str, bytes] = {}
    table = {}
    for case in CASES:
        expected = _expected(case)
        files.update(files_of(FIXTURES / case / "repo"))
        table[expected["release"]] = expected["row"]
    hub.add(_expected(CASES[0])["row"]["repo_id"], files)
    monkeypatch.setattr(sae_releases, "_RELEASES", table)
    return hub


def _load(case: str) -> wb.SAE:
    expected = _expected(case)
    return wb.load_sae(expected["release"], expected["row"]["saes"][0]["id"])


def test_cases_cover_topk_and_relu_tied_and_untied():
    kinds = {(_expected(case)["cfg"]["sae_diff_type"], _expected(case)["cfg"]["tied_weights"]) for case in CASES}
    assert {("topk", True), ("relu", False), ("topk", False)} <= kinds


@pytest.mark.parametrize("case", CASES)
def test_encode_predictions_decode_and_forward_match_saelens(temporal_hub, case):
    sae = _load(case)
    tensors = load_file(str(FIXTURES / case / "expected.safetensors"))
    x = tensors["x"]
    with torch.no_grad():
        torch.testing.assert_close(sae.encode(x), tensors["encode"], atol=1e-5, rtol=0)
        novel, predicted = sae.encode_with_predictions(x)
        torch.testing.assert_close(novel, tensors["novel"], atol=1e-5, rtol=0)
        torch.testing.assert_close(predicted, tensors["predicted"], atol=1e-5, rtol=0)
        torch.testing.assert_close(sae.decode(sae.encode(x)), tensors["decode"], atol=1e-5, rtol=0)
        torch.testing.assert_close(sae(x), tensors["forward"], atol=1e-5, rtol=0)
    assert predicted.abs().sum() > 0  # the context part is exercised


@pytest.mark.parametrize("case", CASES)
def test_config_and_stored_tensors_are_saelens_s(temporal_hub, case):
    expected = _expected(case)
    sae = _load(case)
    theirs, ours = expected["cfg"], sae.cfg.to_dict()
    for name in FIELDS:
        assert ours[name] == theirs[name], name
    for key, value in theirs["metadata"].items():
        if key not in ("sae_lens_version", "sae_lens_training_version"):  # SAELens stamps its own
            assert sae.cfg.metadata[key] == value, key
    names = set(dict(sae.named_parameters()))
    assert ("W_enc" in names) is (not theirs["tied_weights"])
    assert {"W_dec", "b_dec", "attn_layers.1.c_proj.weight", "attn_layers.0.q_target.bias"} <= names
    fetched = {r.path.split("/resolve/main/", 1)[-1] for r in temporal_hub.file_requests("GET")}
    assert fetched == {f"{expected['row']['saes'][0]['path']}/{name}"
                       for name in ("conf.yaml", "latest_ckpt.safetensors")}


def test_a_sequence_is_needed_to_encode(temporal_hub):
    sae = _load(CASES[0])
    with pytest.raises(wb.InputError, match=r"\[batch, pos, d_in\].*got shape \(5, 16\)"):
        sae.encode(torch.randn(5, 16))


def test_positions_see_only_earlier_ones(temporal_hub):
    # Causal: changing the last position leaves every earlier position's codes as they were.
    sae = _load(CASES[0])
    x = load_file(str(FIXTURES / CASES[0] / "expected.safetensors"))["x"]
    edited = x.clone()
    edited[:, -1] += 5.0
    with torch.no_grad():
        before, after = sae.encode_with_predictions(x), sae.encode_with_predictions(edited)
    for ours, theirs in zip(before, after):
        torch.testing.assert_close(ours[:, :-1], theirs[:, :-1], atol=0, rtol=0)


def test_saved_and_reloaded_it_is_the_same_sae(temporal_hub, tmp_path):
    sae = _load("temporal_topk_untied")
    x = load_file(str(FIXTURES / "temporal_topk_untied" / "expected.safetensors"))["x"]
    again = wb.load_sae(sae.save(tmp_path / "sae"))
    with torch.no_grad():
        torch.testing.assert_close(again(x), sae(x), atol=0, rtol=0)


def _toy_temporal(d_in: int, hook_name: str) -> wb.SAE:
    cfg = wb.SAEConfig("temporal", d_in=d_in, d_sae=2 * d_in, n_heads=2, bottleneck_factor=4, n_attn_layers=2,
                       kval_topk=8, tied_weights=False, metadata={"hook_name": hook_name})
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator) / shape[-1] ** 0.5
               for name, shape in cfg_shapes(cfg).items()}
    return wb.SAE.from_tensors(cfg, tensors)


def cfg_shapes(cfg: wb.SAEConfig) -> dict:
    from workbench.sae.architectures import architecture_spec

    return architecture_spec("temporal").weight_shapes(cfg.d_in, cfg.d_sae, cfg.d_out, cfg)


def test_spliced_into_a_model_with_the_error_term_changes_nothing():
    model = wb.load_model("toy-attn-2l")
    hook = "blocks.1.hook_resid_pre"
    sae = _toy_temporal(model.cfg.d_model, hook)
    tokens = torch.arange(1, 9)[None].repeat(2, 1)
    with torch.no_grad():
        clean = model(tokens)
        kept = model.run_with_saes(tokens, saes=[sae], use_error_term=True)
        replaced, cache = model.run_with_cache_with_saes(tokens, saes=[sae])
    torch.testing.assert_close(kept, clean, atol=1e-4, rtol=1e-4)
    assert replaced.shape == clean.shape and not torch.allclose(replaced, clean, atol=1e-3)
    assert cache[f"{hook}.hook_sae_acts_post"].shape == (2, 8, sae.cfg.d_sae)
    # What the splice writes is the SAE's full reconstruction (novel plus predicted codes) of the activation.
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(tokens, names_filter=hook)
        torch.testing.assert_close(cache[f"{hook}.hook_sae_output"], sae(clean_cache[hook]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fields, named", [
    (dict(n_heads=3), "n_heads"),
    (dict(bottleneck_factor=5), "bottleneck_factor"),
    (dict(sae_diff_type="jumprelu"), "sae_diff_type"),
    (dict(kval_topk=0), "kval_topk"),
    (dict(tied_weights="yes"), "tied_weights"),
    (dict(activation_normalization_factor=0.0), "activation_normalization_factor"),
])
def test_bad_config_values_are_config_errors_naming_the_field(fields, named):
    values = dict(d_in=16, d_sae=32, n_heads=2, bottleneck_factor=2)
    values.update(fields)
    with pytest.raises(wb.ConfigError, match=named):
        wb.SAEConfig("temporal", **values)


def test_constant_scalar_rescale_is_temporal_s_only():
    with pytest.raises(wb.ConfigError, match="normalize_activations"):
        wb.SAEConfig("standard", d_in=4, d_sae=8, normalize_activations="constant_scalar_rescale")


def test_conf_yaml_without_its_fields_or_layer_is_a_config_error():
    conf = {"llm": {"dimin": 16}, "data": {"dtype": "float32"}, "sae": {"exp_factor": 2}}
    with pytest.raises(wb.ConfigError, match="sae.n_heads"):
        temporal_config(conf, "m/layer_3/temporal")
    with pytest.raises(wb.ConfigError, match="layer_N"):
        temporal_config(conf, "m/temporal")
    with pytest.raises(wb.ConfigError, match="no 'llm' section"):
        temporal_config({"sae": {}}, "m/layer_3/temporal")


def test_encode_with_predictions_is_a_temporal_sae_s_only():
    sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=2), {
        "W_enc": torch.eye(2), "W_dec": torch.eye(2), "b_enc": torch.zeros(2), "b_dec": torch.zeros(2)})
    with pytest.raises(wb.InputError, match="predicts no codes from context"):
        sae.encode_with_predictions(torch.ones(1, 2, 2))
