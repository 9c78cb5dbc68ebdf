"""The tuned lens: tuned-lens 0.2.0's files and outputs, training, resume, KL by layer, bad input.

Expected values: tuned-lens 0.2.0 itself (tests/fixtures/lenses/make_fixtures.py, run in the reference venv with
transformers 4.57.3): its ``TunedLens`` with fixed translator weights on a tiny random Llama, its logits on fixed
hidden states, and its reading of a lens our ``save`` wrote. Hand calculations: an untrained lens is the logit lens
(zero translators), KL of a distribution to itself is 0.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import workbench as wb
from experiments.plots.lenses import lens_kl_figure
from experiments.lenses import (TunedLens, TunedLensConfig, lens_from_checkpoint, lens_kl_by_layer,
                                train_tuned_lens)
from workbench.errors import CheckpointError, ConfigError, InputError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lenses"
N_LAYERS = 3


@pytest.fixture(scope="module")
def tiny():
    return wb.load_model(str(FIXTURES / "tiny_llama"), progress=False).eval()


@pytest.fixture(scope="module")
def model():
    """The zoo's toy-attn-2l (trained on Python source; 2 layers, d_model 128)."""
    return wb.load_model("toy-attn-2l", progress=False).eval()


@pytest.fixture(scope="module")
def tokens(model):
    return model.to_tokens("def f(x):\n    return x + 1\n" * 3)


@pytest.fixture(scope="module")
def expected():
    return load_file(str(FIXTURES / "expected.safetensors"))


def test_tuned_lens_files_load_and_give_tuned_lens_logits(tiny, expected):
    lens = TunedLens.load(FIXTURES / "reference_lens", tiny)
    assert lens.config.num_hidden_layers == N_LAYERS and lens.config.d_model == 16 and lens.config.bias
    for layer in range(N_LAYERS):
        hidden = expected["hidden"][layer]
        torch.testing.assert_close(lens.transform_hidden(hidden, layer), expected[f"transformed.{layer}"],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lens(hidden, layer), expected[f"logits.{layer}"], atol=1e-5, rtol=1e-5)


def test_the_hidden_states_are_our_models_own_streams(tiny, expected):
    from experiments.lens import residual_snapshots

    prompt = expected["prompt_ids"][None]
    snapshots = residual_snapshots(tiny, prompt)
    n = prompt.shape[1]
    for layer in range(N_LAYERS):
        torch.testing.assert_close(snapshots[layer], expected["hidden"][layer, :n], atol=1e-5, rtol=1e-5)


def test_tuned_lens_reads_the_files_our_save_writes(tiny, expected, tmp_path):
    import sys

    sys.path.insert(0, str(FIXTURES))
    from save_workbench_lens import workbench_lens

    read_by_tuned_lens = load_file(str(FIXTURES / "expected_from_workbench_save.safetensors"))
    with safe_open(str(FIXTURES / "expected_from_workbench_save.safetensors"), "pt") as handle:
        assert handle.metadata()["read_by"] == "tuned_lens.TunedLens.from_model_and_pretrained"
    ours = workbench_lens().attach(tiny)
    for layer in range(N_LAYERS):
        torch.testing.assert_close(ours(expected["hidden"][layer], layer), read_by_tuned_lens[f"logits.{layer}"],
                                   atol=1e-5, rtol=1e-5)
    # What our save writes today is what tuned-lens read: the same config keys and the same tensors.
    ours.config.base_model_name_or_path = "tiny_llama"
    folder = ours.save(tmp_path / "lens")
    assert json.loads((folder / "config.json").read_text()) == json.loads(
        (FIXTURES / "saved_by_workbench" / "config.json").read_text())
    written = torch.load(folder / "params.pt", weights_only=True)
    committed = torch.load(FIXTURES / "saved_by_workbench" / "params.pt", weights_only=True)
    assert sorted(written) == sorted(committed) == sorted(f"{l}.{p}" for l in range(N_LAYERS) for p in ("weight", "bias"))
    for name in committed:
        assert torch.equal(written[name], committed[name])


def test_an_untrained_lens_is_the_logit_lens(tiny, expected):
    lens = TunedLens.for_model(tiny)
    for layer in range(N_LAYERS):
        hidden = expected["hidden"][layer]
        assert torch.equal(lens(hidden, layer), tiny.logits_from_resid(hidden[None])[0])
    final = expected["hidden"][0]
    assert torch.equal(lens(final, N_LAYERS), tiny.logits_from_resid(final[None])[0])  # no translator after the last


def test_save_then_load_round_trips_in_float16(tiny, tmp_path):
    lens = TunedLens.load(FIXTURES / "reference_lens", tiny)
    folder = lens.to(torch.float16).save(tmp_path / "half")
    again = TunedLens.load(folder, tiny)
    assert again.layer_translators[0].weight.dtype == torch.float16
    assert torch.equal(again.layer_translators[2].bias, lens.layer_translators[2].bias)


def test_training_lowers_kl_to_the_final_layer_below_the_logit_lens(model):
    from experiments.corpus_windows import bundled_windows

    windows = bundled_windows(model, n_windows=24, window=64)
    held_out, train = windows[-6:], windows[:-6]
    lens = TunedLens.train(model, train, tokens=1260, tokens_per_step=126, lr=3e-3, progress=False)
    table = lens_kl_by_layer(model, held_out, lens)
    kl = table.pivot(index="layer", columns="lens", values="kl")
    assert (kl.tuned.iloc[:-1] < kl.logit.iloc[:-1]).all()
    assert kl.tuned.iloc[-1] == kl.logit.iloc[-1] == 0.0      # after the last block both are the model's output
    losses = [row["kl_0"] for row in lens.log]
    assert losses[-1] < losses[0]
    assert [trace.name for trace in lens_kl_figure(table).data] == ["logit lens", "tuned lens"]


def test_least_squares_warm_start_beats_the_logit_lens(model):
    from experiments.corpus_windows import bundled_windows

    windows = bundled_windows(model, n_windows=24, window=64)
    lens = train_tuned_lens(model, windows[:-6], tokens=63, tokens_per_step=63, lr=1e-5, init="least_squares",
                            init_tokens=1000, progress=False)
    kl = lens_kl_by_layer(model, windows[-6:], lens).pivot(index="layer", columns="lens", values="kl")
    assert (kl.tuned.iloc[:-1] < 0.6 * kl.logit.iloc[:-1]).all()


def test_least_squares_warm_start_is_the_ridge_fit_at_the_streams_scale(model):
    # Reference: torch.linalg.lstsq on the ridge problem written out as extra rows, sqrt(lambda) I -> 0, with lambda
    # = ridge x the mean input energy per dimension; the fitted map (to the final stream over its RMS) is then
    # multiplied by the RMS of the stream read, c, so the plain tuned-lens weight is c M - I and the bias c b.
    from experiments.corpus_windows import bundled_windows
    from experiments.lenses.training import least_squares_init, streams_and_targets

    windows = bundled_windows(model, n_windows=6, window=64)
    lens = least_squares_init(model, TunedLens.for_model(model), windows, 1, tokens=10_000, ridge=1e-2)
    hidden_LND, final_ND = streams_and_targets(model, windows, first=1)
    target = final_ND.double() / final_ND.double().pow(2).mean(-1, keepdim=True).sqrt()
    for layer in range(model.cfg.n_layers):
        h = hidden_LND[layer].double()
        N, D = h.shape
        inputs = torch.cat([h, torch.ones(N, 1, dtype=torch.float64)], 1)
        lam = 1e-2 * h.pow(2).sum(0).mean()
        rows = torch.cat([inputs, lam.sqrt() * torch.eye(D + 1, dtype=torch.float64)])
        fit = torch.linalg.lstsq(rows, torch.cat([target, torch.zeros(D + 1, D, dtype=torch.float64)])).solution
        c = h.pow(2).mean().sqrt()
        translator = lens.layer_translators[layer]
        torch.testing.assert_close(translator.weight.double(), c * fit[:D].T - torch.eye(D, dtype=torch.float64),
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(translator.bias.double(), c * fit[D], atol=1e-4, rtol=1e-4)


def test_a_float16_lens_trains_in_float32(model, tokens, tmp_path):
    # float16's spacing near 1 is 2**-11 ~ 5e-4: AdamW steps of 1e-5 on float16 weights would round to nothing.
    lens = TunedLens.for_model(model).to(torch.float16)
    train_tuned_lens(model, tokens.repeat(2, 1), lens=lens, tokens=26, tokens_per_step=13, lr=1e-5,
                     checkpoint_dir=tmp_path, progress=False)
    assert {p.dtype for p in lens.parameters()} == {torch.float32}
    payload = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert {t.dtype for state in payload["optimizer"]["state"].values() for name, t in state.items()
            if name != "step"} == {torch.float32}
    assert 0 < float(lens.layer_translators[0].weight.abs().max()) < 1e-4   # moved by about lr per step


class _Stop(Exception):
    pass


def test_a_stopped_run_resumes_from_its_checkpoint_to_the_same_lens(model, tokens, tmp_path):
    data = tokens.repeat(6, 1)
    options = dict(tokens=78, tokens_per_step=13, checkpoint_every=2, lr=1e-2)
    whole = train_tuned_lens(model, data, progress=False, **options)

    def stop_after_three(done, total):
        if done == 3:
            raise _Stop

    with pytest.raises(_Stop):
        train_tuned_lens(model, data, progress=stop_after_three, checkpoint_dir=tmp_path, **options)
    assert [row["step"] for row in lens_from_checkpoint(model, tmp_path).log] == [1, 2]
    seen = []
    resumed = train_tuned_lens(model, data, progress=lambda done, total: seen.append(done), checkpoint_dir=tmp_path,
                               **options)
    assert seen[0] == 2 and seen[-1] == 6
    for a, b in zip(whole.layer_translators.parameters(), resumed.layer_translators.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert [row["step"] for row in resumed.log] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(CheckpointError, match="another lens or run"):
        train_tuned_lens(model, data, progress=False, checkpoint_dir=tmp_path, **{**options, "tokens": 26})


def test_training_leaves_the_model_as_it_was(model, tokens):
    flags = [p.requires_grad for p in model.parameters()]
    before = {name: p.clone() for name, p in model.named_parameters()}
    train_tuned_lens(model, tokens.repeat(2, 1), tokens=26, tokens_per_step=13, progress=False)
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    assert sum(len(point.fwd_hooks) + len(point.bwd_hooks) for point in model.hook_dict.values()) == 0


def test_bad_input_is_a_clear_error(tiny, model, tmp_path):
    lens = TunedLens.load(FIXTURES / "reference_lens")
    with pytest.raises(InputError, match="no model to read out through"):
        lens(torch.zeros(16), 0)
    with pytest.raises(InputError, match="d_model=16, 3 layers; the model has d_model=128"):
        lens.attach(model)
    lens.attach(tiny)
    with pytest.raises(InputError, match=r"layer must be an int in \[0, 3\]"):
        lens(torch.zeros(16), 4)
    with pytest.raises(InputError, match="width 8"):
        lens(torch.zeros(8), 0)
    folder = lens.save(tmp_path / "ok")
    wrong = {f"{l}.{p}": torch.zeros(8, 8) if p == "weight" else torch.zeros(8) for l in range(3) for p in ("weight", "bias")}
    torch.save(wrong, folder / "params.pt")
    with pytest.raises(CheckpointError, match=r"0.weight has shape \(8, 8\), expected \(16, 16\)"):
        TunedLens.load(folder)
    torch.save({k: v.long() for k, v in torch.load(FIXTURES / "reference_lens" / "params.pt", weights_only=True).items()},
               folder / "params.pt")
    with pytest.raises(CheckpointError, match="not a floating-point tensor"):
        TunedLens.load(folder)
    (folder / "params.pt").write_bytes(pickle.dumps(_Stop()))   # a pickle that would run code: refused unread
    with pytest.raises(CheckpointError, match="weights_only=True"):
        TunedLens.load(folder)
    (folder / "config.json").write_text(json.dumps({"base_model_name_or_path": "m", "d_model": 0, "num_hidden_layers": 3}))
    with pytest.raises(ConfigError, match="d_model must be a positive integer"):
        TunedLens.load(folder)
    with pytest.raises(CheckpointError, match="not a folder"):
        TunedLens.load(tmp_path / "missing")
    with pytest.raises(InputError, match="optimizer must be one of"):
        train_tuned_lens(model, torch.zeros(2, 8, dtype=torch.long), optimizer="rmsprop", progress=False)
    with pytest.raises(InputError, match="token windows"):
        train_tuned_lens(model, torch.zeros(2, 8), progress=False)
    assert TunedLensConfig.from_dict({"base_model_name_or_path": "m", "d_model": 4, "num_hidden_layers": 1,
                                      "unknown": 1}).bias


def test_the_shipped_smollm2_lens_is_a_tuned_lens_folder_with_a_card():
    from experiments.lenses.shipped import shipped_tuned_lens

    folder = shipped_tuned_lens("smollm2-135m")
    assert folder is not None and (folder / "CARD.md").is_file()
    lens = TunedLens.load(folder)   # every key, shape and value checked
    assert (lens.config.d_model, lens.config.num_hidden_layers) == (576, 30)
    assert lens.layer_translators[0].weight.dtype == torch.float16
    assert shipped_tuned_lens("toy-attn-2l") is None


def test_a_shipped_lens_loads_by_name_and_a_folder_of_that_name_comes_first(tiny, tmp_path, monkeypatch):
    from experiments.lenses.shipped import shipped_tuned_lens

    by_name = TunedLens.load("smollm2-135m-tuned-lens")   # as wb.load_sae("smollm2-135m-resid14-topk")
    by_path = TunedLens.load(shipped_tuned_lens("smollm2-135m"))
    assert by_path.layer_translators[0].weight.dtype == torch.float16   # the files, as tuned-lens reads them
    assert by_name.layer_translators[0].weight.dtype == torch.float32   # by name, float32 as a shipped SAE
    assert all(torch.equal(a.float(), b) for a, b in zip(by_path.layer_translators.state_dict().values(),
                                                         by_name.layer_translators.state_dict().values()))
    monkeypatch.chdir(tmp_path)   # a local folder of that name is read instead, as load_sae reads one
    TunedLens.for_model(tiny).save(tmp_path / "smollm2-135m-tuned-lens")
    assert TunedLens.load("smollm2-135m-tuned-lens").config.d_model == tiny.cfg.d_model != 576
    with pytest.raises(CheckpointError, match="nor the name of a shipped one"):
        TunedLens.load("no-such-lens")
    with pytest.raises(CheckpointError, match="not a folder holding a tuned lens"):
        TunedLens.load("../smollm2-135m-tuned-lens")   # a path is never looked up in the zoo


def test_the_shipped_gemma_lens_is_a_tuned_lens_folder_with_a_card():
    from experiments.lenses.shipped import shipped_tuned_lens

    folder = shipped_tuned_lens("gemma-3-270m")
    assert folder is not None and folder.name == "gemma-3-270m-tuned-lens" and (folder / "CARD.md").is_file()
    lens = TunedLens.load(folder)   # every key, shape and value checked
    assert (lens.config.d_model, lens.config.num_hidden_layers) == (640, 18)   # Gemma 3 270M's width and depth
    assert lens.layer_translators[0].weight.dtype == torch.float16


def test_bfloat16_training_measures_the_same_kl_and_still_trains(model, tokens):
    # The first step's KL is read before any update, so the two precisions see the same lens: they differ only by
    # bfloat16's rounding of the readout (8 bits of mantissa: a few parts in a thousand of each logit).
    windows = tokens.repeat(4, 1)
    exact = TunedLens.train(model, windows, tokens=104, tokens_per_step=26, lr=3e-3, progress=False)
    fast = TunedLens.train(model, windows, tokens=104, tokens_per_step=26, lr=3e-3, progress=False,
                           precision="bfloat16")
    for layer in range(model.cfg.n_layers):
        assert fast.log[0][f"kl_{layer}"] == pytest.approx(exact.log[0][f"kl_{layer}"], rel=0.05)
        assert fast.log[-1][f"kl_{layer}"] < fast.log[0][f"kl_{layer}"]          # it trains
    assert fast.layer_translators[0].weight.dtype == torch.float32                # autocast leaves the weights alone
    with pytest.raises(InputError, match="precision must be one of"):
        TunedLens.train(model, windows, tokens=26, tokens_per_step=26, progress=False, precision="float16")
