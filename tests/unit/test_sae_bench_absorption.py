"""SAEBench's first-letter absorption (``experiments.sae.bench.absorption``): its absorption fraction and full
absorption on hand-worked latents, a planted absorbing latent found and measured, the toy model over seeds, and
bad input."""

from __future__ import annotations

import math

import pytest
import torch

import workbench as wb
from experiments.sae.bench import run_bench
from experiments.sae.bench.absorption import (absorption_fraction, absorption_metrics, f1_score, first_letter_prompt,
                                              is_full_absorption, letter_absorption, summarise)
from workbench.errors import InputError


@pytest.fixture(scope="module")
def model():
    return wb.load_model("toy-attn-2l", progress=False).eval()


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("projection, latent_projections, cosines, main, expected", [
    (4.0, [4.0, 3.0], [1.0, 0.5], [0], 0.0),          # the main latent carries the whole projection
    (4.0, [0.0, 3.0], [1.0, 0.5], [0], 1.0),          # main silent, 3 / 4 >= 0.4 absorbed: all of it
    (4.0, [1.0, 2.5], [1.0, 0.5], [0], 2.5 / 3.5),    # min(2.5, 4 - 1) / (2.5 + 1)
    (4.0, [1.0, 1.2], [1.0, 0.5], [0], 0.0),          # 1.2 / 4 = 0.3 < 0.4: not absorption
    (4.0, [0.0, 3.0], [1.0, 0.05], [0], 0.0),         # the absorber's cosine 0.05 < 0.1 does not count
    (4.0, [0.5, 0.5, 0.5, 0.5, 0.5], [1.0, 0.2, 0.2, 0.2, 0.2], [0], 0.0),   # top 3 only: 1.5 / 4 < 0.4
    (3.0, [0.5, 0.5, 0.5, 0.5, 0.5], [1.0, 0.2, 0.2, 0.2, 0.2], [0], 0.75),  # 1.5 / 3 >= 0.4: 1.5 / (1.5 + 0.5)
    (4.0, [-1.0, 3.0], [-1.0, 0.5], [0], 1.0),        # the main latents' projection is negative: all absorbed
])
def test_absorption_fraction_by_hand(projection, latent_projections, cosines, main, expected):
    value = absorption_fraction(projection, torch.tensor(latent_projections), torch.tensor(cosines), main)
    assert value == pytest.approx(expected, abs=1e-6)


def test_full_absorption_by_hand():
    cos = torch.tensor([0.9, 0.5, 0.01])
    assert is_full_absorption(4.0, torch.tensor([0.0, 6.0, 0.0]), cos, [0])        # 6 * 0.5 = 3 >= 0.4 * 4
    assert not is_full_absorption(4.0, torch.tensor([0.1, 6.0, 0.0]), cos, [0])    # the main latent fires
    assert not is_full_absorption(4.0, torch.tensor([0.0, 3.0, 0.0]), cos, [0])    # 1.5 / 4 < 0.4
    assert not is_full_absorption(-1.0, torch.tensor([0.0, 6.0, 0.0]), cos, [0])   # the probe is not activated
    assert not is_full_absorption(4.0, torch.tensor([0.0, 0.0, 900.0]), cos, [0])  # top latent's cosine < 0.025


def test_f1_and_prompt_by_hand():
    # tp = 1, fp = 2, fn = 1: 2 / (2 + 2 + 1)
    assert f1_score(torch.tensor([True, True, True, False]), torch.tensor([True, False, False, True])) == 0.4
    assert f1_score(torch.tensor([False, False]), torch.tensor([False, False])) == 0.0
    assert first_letter_prompt("Zoo", [" apple"]) == "\n apple has the first letter: A\nZoo has the first letter:"


def test_a_planted_absorbing_latent_is_measured():
    # Words of letter a have activation 3 e0, of letter b 3 e1. Latent 0 (decoder e0) is a's, latent 1 (e1) b's,
    # each firing 3.3 (a little over the probe's projection, so it accounts for all of it). Latent 2 (decoder e0)
    # absorbs a: on two of the four held-out a-words latent 0 is silent and latent 2 fires instead.
    # a's probe is symmetric between e0 and -e1, so each word's projection is 3 cos(d, e0), latent 2's too: those two
    # words are fully absorbed (fraction 1), the other two not (0): a's fraction and full rate are 2 / 4.
    letters = torch.tensor([0, 1] * 10)
    acts = torch.nn.functional.one_hot(letters, 4).float() * 3.0
    latents = torch.zeros(20, 3)
    latents[letters == 0, 0] = 3.3
    latents[letters == 1, 1] = 3.3
    absorbed = [12, 14]  # held-out rows 12..19 hold a-words 12, 14, 16, 18
    latents[absorbed, 0], latents[absorbed, 2] = 0.0, 3.0
    decoder = torch.stack([torch.eye(4)[0], torch.eye(4)[1], torch.eye(4)[0]])
    per_letter = letter_absorption(acts, latents, decoder, letters, 12, seed=0)
    a, b = per_letter["a"], per_letter["b"]
    assert (a["probe_f1"], a["true_positives"], a["num_split_features"]) == (1.0, 4, 1)
    assert a["mean_absorption_fraction"] == pytest.approx(0.5) and a["full_absorption_rate"] == pytest.approx(0.5)
    assert b["mean_absorption_fraction"] == 0.0 and b["full_absorption_rate"] == 0.0
    summary = summarise(per_letter)  # means over the two letters
    assert summary["n_letters"] == 2 and summary["mean_absorption_fraction_score"] == pytest.approx(0.25)
    assert summary["mean_full_absorption_score"] == pytest.approx(0.25)


def test_toy_model_over_seeds_and_bad_input(model):
    sae = wb.load_sae("toy-attn-2l-resid1-topk")
    table = absorption_metrics(model, sae, seeds=(0, 1), max_words=80, progress=False)
    assert list(table.columns) == ["value", "std", "seed_0", "seed_1"]
    assert len(table.attrs["per_letter"]) == 2
    # the toy model learnt Python code, not spelling: no letter's probe reaches F1 0.6, so nothing is measured
    assert table.loc["n_letters", "value"] == 0 and math.isnan(table.loc["mean_absorption_fraction_score", "value"])
    bench = run_bench(model, {"toy": sae}, None, measures=("absorption",), seeds=(0, 1), max_words=80, progress=False)
    assert set(bench["eval"]) == {"absorption"}
    lost = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=model.cfg.d_model, d_sae=4,
                                            metadata={"hook_name": "blocks.9.hook_resid_post"}),
                               {"W_enc": torch.zeros(model.cfg.d_model, 4), "W_dec": torch.zeros(4, model.cfg.d_model),
                                "b_enc": torch.zeros(4), "b_dec": torch.zeros(model.cfg.d_model)})
    with pytest.raises(InputError, match="blocks.9.hook_resid_post"):
        absorption_metrics(model, lost, progress=False)
    with pytest.raises(InputError, match="max_words"):
        absorption_metrics(model, sae, max_words=3, progress=False)


def test_command_line_runs_the_chosen_measures(tmp_path):
    from experiments.cli.sae import bench

    table = bench(["--model", "toy-attn-2l", "--sae", "toy-attn-2l-resid1-topk", "--measures", "absorption",
                   "--max-words", "40", "--seeds", "2", "--out", str(tmp_path), "--no-progress", "--quiet"])
    assert set(table["eval"]) == {"absorption"} and {"seed_0", "seed_1"} <= set(table.columns)
    assert (tmp_path / "bench.csv").is_file()
    with pytest.raises(InputError, match="not a SAEBench measure"):
        bench(["--model", "toy-attn-2l", "--sae", "toy-attn-2l-resid1-topk", "--measures", "nonsense",
               "--out", str(tmp_path), "--no-progress", "--quiet"])
