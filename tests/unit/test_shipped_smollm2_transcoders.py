"""The transcoders shipped for SmolLM2-135M: listed and loaded by name in circuit-tracer's per-layer format (every
layer, float16 on disk, within the repository's 80 MB), fitting the model, and their card's figures the ones
``tools/measure_smollm2_transcoders.py`` measured (its ``metrics.json``), re-measured here for the layers' explained
variance on the held-out windows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

import workbench as wb

NAME = "smollm2-135m-skip-transcoders"
FOLDER = Path(wb.__file__).resolve().parent / "zoo" / "smollm2-135m" / "transcoders" / NAME
TOOLS = Path(__file__).resolve().parents[2] / "tools"
N_LAYERS, D_MODEL = 30, 576  # SmolLM2-135M's (its GGUF's config)


def measure_tool():
    spec = importlib.util.spec_from_file_location("measure_smollm2_transcoders",
                                                  TOOLS / "measure_smollm2_transcoders.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_set_is_listed_for_smollm2_and_loads_by_name_with_every_layer():
    row = wb.shipped(kind="transcoders", model="smollm2-135m").set_index("name").loc[NAME]
    assert (row.architecture, row.hook_name, Path(row.path)) == ("transcoder_set", "ln2.hook_normalized", FOLDER)
    config = yaml.safe_load((FOLDER / "config.yaml").read_text())
    assert config["model_kind"] == "transcoder_set" and len(config["transcoders"]) == N_LAYERS
    tc = wb.load_transcoders(NAME)
    assert (tc.n_layers, tc.d_model, tc.cross_layer, tc.skip_connection) == (N_LAYERS, D_MODEL, False, True)
    assert tc.input_hook(3) == "blocks.3.ln2.hook_normalized" and tc.output_hook(3) == "blocks.3.hook_mlp_out"
    assert all(t is not None and (t >= 0).all() for t in tc.threshold)   # JumpReLU, as circuit-tracer applies it
    assert tc.W_enc[0].dtype == torch.float32   # read in float32 by default
    assert tc.W_enc[0].shape == (tc.d_transcoder, D_MODEL) and tc.W_skip[29].shape == (D_MODEL, D_MODEL)


def test_the_files_are_float16_and_within_80_mb():
    files = sorted(FOLDER.glob("layer_*.safetensors"))
    assert len(files) == N_LAYERS
    for path in files:
        with safe_open(str(path), framework="pt") as file:
            assert {file.get_slice(name).get_dtype() for name in file.keys()} == {"F16"}, path
    assert sum(p.stat().st_size for p in FOLDER.rglob("*") if p.is_file()) <= 80 * 10**6


def test_the_card_shows_the_measured_figures():
    figures = json.loads((FOLDER / "metrics.json").read_text())
    card = (FOLDER / "CARD.md").read_text()
    assert measure_tool().card_tables(figures) in card
    assert len(figures["layers"]) == N_LAYERS and len(figures["graphs"]) == 5   # five held-out prompts
    assert "tools/measure_smollm2_transcoders.py" in card and "tools/train_smollm2_transcoders.py" in card


def test_the_layers_explained_variance_is_reproduced_on_the_held_out_windows(smollm2):
    from experiments.cli.sae import data_windows

    figures = json.loads((FOLDER / "metrics.json").read_text())
    tc = wb.load_transcoders(NAME)
    tc.check_model(smollm2)
    try:
        windows = data_windows(smollm2, "english-held-out", n_windows=figures["windows"] + 5)[:figures["windows"]]
    except wb.InputError as error:   # the English corpus: make setup-corpus
        pytest.skip(str(error))
    measured = measure_tool().layer_quality(smollm2, tc, windows)
    for row, card in zip(measured, figures["layers"]):
        assert row["explained_variance"] == pytest.approx(card["explained_variance"], abs=2e-3), row
        assert row["l0"] == pytest.approx(card["l0"], abs=0.5), row


def test_the_attribution_page_offers_the_set_first_for_smollm2():
    from app.results.attribution import transcoder_choices
    from app.state import LoadedModel

    toy = wb.load_model("toy-attn-2l", progress=False)   # only the name the page opened the model by is read
    choices = transcoder_choices(LoadedModel(toy, "smollm2-135m|sdpa"))   # the model as the page names it
    assert list(choices)[0] == NAME and choices[NAME] == FOLDER
