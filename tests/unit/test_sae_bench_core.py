"""SAEBench's core measures (``experiments.sae.bench``): hand-worked SAEs, KL and CE by hand from the model's
logits, spread over seeds, the disk cache, the command line and bad input."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import workbench as wb
from experiments.sae.bench import core_metrics, differs, run_bench
from workbench.errors import InputError

HOOK = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def model():
    return wb.load_model("toy-attn-2l", progress=False).eval()


@pytest.fixture(scope="module")
def pool(model):
    """16 rows of 16 tokens, each starting with BOS (which SAEBench leaves out of every average)."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(1, model.cfg.d_vocab, (16, 16), generator=generator)
    rows[:, 0] = model.tokenizer.bos_token_id
    return rows


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))


def _sae(model, W_enc, W_dec, b_enc=None, hook=HOOK):
    d_sae = W_enc.shape[1]
    return wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=model.cfg.d_model, d_sae=d_sae,
                                            metadata={"hook_name": hook}),
                               {"W_enc": W_enc, "W_dec": W_dec, "b_enc": torch.zeros(d_sae) if b_enc is None else b_enc,
                                "b_dec": torch.zeros(model.cfg.d_model)})


def _scaled(model, scale: float):
    """ReLU(x) and ReLU(-x) as features, decoded back times ``scale``: x_hat = scale * x exactly."""
    eye = torch.eye(model.cfg.d_model)
    return _sae(model, torch.cat([eye, -eye], 1), scale * torch.cat([eye, -eye]))


def _random(model, d_sae=64, seed=1):
    generator = torch.Generator().manual_seed(seed)
    W_enc = torch.randn(model.cfg.d_model, d_sae, generator=generator) / math.sqrt(model.cfg.d_model)
    W_dec = torch.randn(d_sae, model.cfg.d_model, generator=generator) / math.sqrt(d_sae)
    return _sae(model, W_enc, W_dec, b_enc=-0.05 * torch.ones(d_sae))


def _core(model, sae, data, **kwargs):
    kwargs.setdefault("seeds", (0,))
    kwargs.setdefault("n_tokens", data.numel())
    return core_metrics(model, sae, data, progress=False, **kwargs)


def test_identity_sae_reconstructs_perfectly(model, pool):
    table = _core(model, _scaled(model, 1.0), pool)
    for measure, expected in {"explained_variance": 1.0, "mse": 0.0, "cossim": 1.0, "kl_div_score": 1.0,
                              "ce_loss_score": 1.0, "l2_ratio": 1.0, "relative_reconstruction_bias": 1.0,
                              "kl_div_with_sae": 0.0}.items():
        assert table.loc[measure, "value"] == pytest.approx(expected, abs=1e-5), measure
    assert table.loc["ce_loss_with_sae", "value"] == pytest.approx(table.loc["ce_loss_without_sae", "value"], abs=1e-5)


def test_zero_sae_is_the_ablation(model, pool):
    zero = _sae(model, torch.zeros(model.cfg.d_model, 8), torch.zeros(8, model.cfg.d_model))
    table = _core(model, zero, pool)
    assert table.loc["kl_div_score", "value"] == pytest.approx(0.0, abs=1e-6)
    assert table.loc["ce_loss_score", "value"] == pytest.approx(0.0, abs=1e-6)
    assert table.loc["l0", "value"] == 0.0 and table.loc["l1", "value"] == 0.0
    assert table.loc["frac_alive", "value"] == 0.0  # all dead
    assert table.loc["l2_norm_out", "value"] == 0.0 and table.loc["l2_ratio", "value"] == 0.0


def test_scaled_down_sae_shrinks_by_half(model, pool):
    table = _core(model, _scaled(model, 0.5), pool)
    assert table.loc["l2_ratio", "value"] == pytest.approx(0.5, abs=1e-6)
    assert table.loc["cossim", "value"] == pytest.approx(1.0, abs=1e-6)
    assert table.loc["relative_reconstruction_bias", "value"] == pytest.approx(0.5, abs=1e-6)  # 0.25 / 0.5
    assert table.loc["l2_norm_out", "value"] == pytest.approx(0.5 * table.loc["l2_norm_in", "value"], rel=1e-6)


def test_kl_ce_and_variance_equal_a_hand_calculation_on_one_batch(model, pool):
    sae = _random(model)
    batch = pool[:4]
    keep = batch != model.tokenizer.bos_token_id
    with torch.no_grad():
        clean, cache = model.run_with_cache(batch, names_filter=HOOK)
        x = cache[HOOK]
        x_hat = sae.decode(sae.encode(x))
        spliced = model.run_with_hooks(batch, fwd_hooks=[(HOOK, lambda act, hook: x_hat)])
        ablated = model.run_with_hooks(batch, fwd_hooks=[(HOOK, lambda act, hook: torch.zeros_like(act))])

        def kl(new):  # sum_v p (log p - log q), by torch's own kl_div
            return torch.nn.functional.kl_div(torch.log_softmax(new, -1), torch.log_softmax(clean, -1),
                                              reduction="none", log_target=True).sum(-1)[keep].mean()

        def ce(logits):
            losses = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(),
                                                       reduction="none").view(4, -1)
            return losses[keep[:, :-1]].mean()

    kl_sae, kl_abl = float(kl(spliced)), float(kl(ablated))
    ce_clean, ce_sae, ce_abl = float(ce(clean)), float(ce(spliced)), float(ce(ablated))
    xk, rk = x[keep], (x - x_hat)[keep]
    variance = xk.pow(2).sum(-1).mean() - xk.pow(2).mean() ** 2  # SAEBench's total variance, one batch
    table = _core(model, sae, batch, batch_size=4)
    expected = {"kl_div_with_sae": kl_sae, "kl_div_with_ablation": kl_abl, "kl_div_score": (kl_abl - kl_sae) / kl_abl,
                "ce_loss_without_sae": ce_clean, "ce_loss_with_sae": ce_sae, "ce_loss_with_ablation": ce_abl,
                "ce_loss_score": (ce_abl - ce_sae) / (ce_abl - ce_clean),
                "explained_variance": float(1 - rk.pow(2).sum(-1).mean() / variance),
                "mse": float(rk.pow(2).sum(-1).mean() / keep.sum())}
    for measure, value in expected.items():
        assert table.loc[measure, "value"] == pytest.approx(value, rel=1e-4, abs=1e-6), measure
    assert table.loc["kl_div_with_sae", "value"] > 0  # a random SAE does change the output


def test_seeds_spread_a_random_sae_but_not_the_identity(model, pool):
    noisy = _core(model, _random(model), pool, seeds=(0, 1, 2), n_tokens=64)
    assert noisy.loc["kl_div_with_sae", "std"] > 0 and noisy.loc["l0", "std"] > 0
    assert list(noisy.columns) == ["value", "std", "seed_0", "seed_1", "seed_2"]
    assert noisy.loc["l0", "value"] == pytest.approx(noisy.loc["l0", ["seed_0", "seed_1", "seed_2"]].mean())
    exact = _core(model, _scaled(model, 1.0), pool, seeds=(0, 1, 2), n_tokens=64)
    for measure in ("kl_div_score", "explained_variance", "cossim", "l2_ratio", "ce_loss_score"):
        assert exact.loc[measure, "std"] == pytest.approx(0.0, abs=1e-6), measure


def test_disk_cache_skips_the_forward_pass_and_a_changed_weight_misses_it(model, pool):
    sae = _random(model)
    forwards = []
    handle = model.hook_dict["hook_embed"].register_forward_hook(lambda *args: forwards.append(1))
    try:
        first = _core(model, sae, pool, seeds=(0, 1), n_tokens=64)
        assert forwards
        forwards.clear()
        again = _core(model, sae, pool, seeds=(0, 1), n_tokens=64)
        assert not forwards
        pd.testing.assert_frame_equal(first, again)
        with torch.no_grad():
            sae.W_dec[0, 0] += 1.0
        _core(model, sae, pool, seeds=(0, 1), n_tokens=64)
        assert forwards
    finally:
        handle.remove()


def test_run_bench_compares_saes_beyond_their_spread(model, pool):
    saes = {"identity": _scaled(model, 1.0), "random": _random(model)}
    table = run_bench(model, saes, pool, seeds=(0, 1), n_tokens=64, progress=False)
    assert len(table) == 2 * len(set(table["measure"])) and set(table["eval"]) == {"core"}
    verdict = differs(table, "identity", "random", "explained_variance")
    assert verdict["verdict"] == "differs" and verdict["difference"] > 0
    same = differs(table, "identity", "identity", "explained_variance")
    assert same["difference"] == 0 and same["verdict"] == "within spread"


def test_command_line_writes_core_csv(model, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("The cat sat on the mat. A dog ran in the park. " * 150)
    sae_dir = tmp_path / "sae"
    _scaled(model, 0.5).save_model(sae_dir)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "experiments.sae", "bench", "--model", "toy-attn-2l", "--sae",
                           str(sae_dir), "--data", str(text), "--out", str(out), "--tokens", "128", "--seeds", "2",
                           "--no-progress"], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    table = pd.read_csv(out / "core.csv")
    assert set(table.columns) >= {"sae", "eval", "measure", "value", "std", "seed_0", "seed_1"}
    assert table.set_index("measure").loc["l2_ratio", "value"] == pytest.approx(0.5, abs=1e-5)
    assert "l2_ratio" in done.stdout


def test_bad_input_is_a_clear_error(model, pool):
    lost = _sae(model, torch.zeros(model.cfg.d_model, 4), torch.zeros(4, model.cfg.d_model),
                hook="blocks.9.hook_resid_post")
    with pytest.raises(InputError, match="blocks.9.hook_resid_post"):
        core_metrics(model, lost, pool, progress=False)
    with pytest.raises(InputError, match="blocks.9.hook_resid_post"):
        run_bench(model, {"lost": lost}, pool, progress=False)
    with pytest.raises(InputError, match="seeds"):
        core_metrics(model, _scaled(model, 1.0), pool, seeds=(), progress=False)
    with pytest.raises(InputError, match="not built yet"):
        run_bench(model, {"a": _scaled(model, 1.0)}, pool, measures=("scr",))
    with pytest.raises(InputError, match="not a SAEBench measure"):
        run_bench(model, {"a": _scaled(model, 1.0)}, pool, measures=("nonsense",))
    with pytest.raises(InputError, match="sae=.nobody"):
        differs(run_bench(model, {"a": _scaled(model, 1.0)}, pool, seeds=(0,), n_tokens=16, progress=False),
                "a", "nobody", "l0")
