"""Probes per hook on a real (zoo) model: a planted linear feature is read at high held-out accuracy, the monitor's
scores are the probe's scores of the cached activations, and bad input leaves nothing attached."""

import pytest
import torch

import workbench as wb
from experiments.plots.probes import probe_scores_figure
from experiments.probes import fit_mass_mean, probe_activations, probe_monitor, sparse_probe, train_probe
from workbench.errors import InputError

HOOK = "blocks.1.hook_resid_post"


@pytest.fixture(scope="module")
def model():
    return wb.load_model("toy-attn-2l")


@pytest.fixture(scope="module")
def texts():
    words = ["import", "def", "return", "class", "self", "for", "while", "print", "value", "data", "name", "list"]
    return [f"{a} {b} {c}" for a in words for b in words for c in words[6:10]]


def _attached(model):
    return sum(len(point._forward_hooks) for point in model.hook_dict.values())


def test_a_planted_linear_feature_is_read_at_held_out_accuracy_of_at_least_095(model, texts):
    # The planted feature: the sign of the activation's projection on a fixed random direction, with a margin
    # (rows too close to the boundary dropped), so a linear probe can read it and nothing else defines it.
    acts = probe_activations(model, texts, [HOOK], progress=False)[HOOK]
    direction = torch.randn(acts.shape[1], generator=torch.Generator().manual_seed(0))
    projection = (acts - acts.mean(0)) @ direction
    keep = projection.abs() > projection.abs().median() * 0.25
    kept_texts = [t for t, k in zip(texts, keep.tolist()) if k]
    labels = (projection[keep] > 0).long()
    for kind in ("logistic", "mass_mean"):
        # The unwhitened mass-mean direction is the covariance times the planted one; its iid variant undoes that.
        run = train_probe(model, kept_texts, labels, [HOOK], kind=kind, test_fraction=0.3, seeds=(0, 1, 2),
                          C=10.0, whiten=True, progress=False)
        row = run.table.iloc[0]
        assert row["accuracy"] >= 0.95, (kind, row.to_dict())
        assert row["auroc"] >= 0.95 and row["seeds"] == 3 and row["layer"] == 1


def test_the_table_has_one_row_per_hook_and_draws(model, texts):
    hooks = ["hook_embed", "blocks.0.hook_resid_post", "ln_final.hook_normalized"]
    labels = [len(t.split()[0]) > 4 for t in texts]
    run = train_probe(model, texts, torch.tensor(labels).long(), hooks, test_fraction=0.25, progress=False)
    assert run.table["hook_name"].tolist() == hooks and set(run.probes) == set(hooks)
    assert run.table["layer"].tolist()[1] == 0 and run.table["layer"].isna().tolist() == [True, False, True]
    assert [trace.name for trace in probe_scores_figure(run.table).data] == ["accuracy", "AUROC"]


def test_mean_reading_averages_only_real_tokens(model):
    texts = ["import os", "def f(x): return x"]
    batched = probe_activations(model, texts, [HOOK], reading="mean", progress=False)[HOOK]
    for row, text in enumerate(texts):
        _, cache = model.run_with_cache(text, names_filter=[HOOK], progress=False)
        assert torch.allclose(batched[row], cache[HOOK][0].mean(0), atol=1e-5)


def test_the_monitor_scores_every_token_read_during_generation_and_detaches(model, texts):
    acts = probe_activations(model, texts[:20], [HOOK], progress=False)[HOOK]
    probe = fit_mass_mean(acts, torch.tensor([0, 1] * 10))
    with probe_monitor(model, probe, HOOK, threshold=0.0) as log:
        out = model.generate("import os", 4, verbose=False)
    assert _attached(model) == 0
    tokens = model.to_tokens(out)[:, :-1]          # every token but the last was fed to the model
    _, cache = model.run_with_cache(tokens, names_filter=[HOOK], progress=False)
    expected = probe.score(cache[HOOK][0])
    assert torch.allclose(log.scores()[0], expected, atol=1e-4)
    assert torch.equal(log.flagged()[0], log.scores()[0] > 0)


@pytest.mark.parametrize("call, message", [
    (lambda m, t: train_probe(m, t[:4], [1, 1, 1, 1], [HOOK], progress=False), "one class"),
    (lambda m, t: train_probe(m, t[:4], [0, 1, 0], [HOOK], progress=False), "one class per text"),
    (lambda m, t: train_probe(m, t[:8], [0, 1] * 4, ["blocks.9.hook_resid_post"], progress=False), "blocks.9"),
    (lambda m, t: train_probe(m, t[:8], [0, 1] * 4, [HOOK], kind="svm", progress=False), "kind"),
    (lambda m, t: probe_activations(m, [], [HOOK], progress=False), "non-empty"),
])
def test_bad_probe_requests_get_clear_errors_and_leave_no_hook(model, texts, call, message):
    with pytest.raises(InputError, match=message):
        call(model, texts)
    assert _attached(model) == 0


def test_a_monitor_left_by_an_error_is_detached(model):
    probe = fit_mass_mean(torch.randn(4, model.cfg.d_model), torch.tensor([0, 1, 0, 1]))
    with pytest.raises(RuntimeError):
        with probe_monitor(model, probe, HOOK):
            raise RuntimeError("interrupted")
    assert _attached(model) == 0
    with pytest.raises(InputError, match="two-class"):
        with probe_monitor(model, object(), HOOK):
            pass


def test_a_sparse_probe_reads_the_latent_that_carries_the_planted_feature(model, texts):
    # A hand-built ReLU SAE: latent 0 reads a fixed direction ten times harder than the other latents read theirs,
    # so its class-mean difference is by far the largest when the labels are "latent 0 fires well above zero".
    hook = "blocks.1.hook_resid_post"
    acts = probe_activations(model, texts, [hook], progress=False)[hook]
    generator = torch.Generator().manual_seed(0)
    sae = wb.SAE(wb.SAEConfig("standard", d_in=acts.shape[1], d_sae=8, metadata={"hook_name": hook}))
    with torch.no_grad():
        sae.W_enc.copy_(torch.randn(acts.shape[1], 8, generator=generator) * 0.01)
        direction = torch.randn(acts.shape[1], generator=generator)
        sae.W_enc[:, 0] = direction / direction.norm()
        sae.b_enc.zero_(), sae.b_dec.zero_()
        sae.b_enc[0] = -float((acts @ sae.W_enc[:, 0]).median())   # fires on about half the texts
        latent0 = sae.encode(acts)[:, 0]
    keep = (latent0 == 0) | (latent0 > latent0[latent0 > 0].median() * 0.2)   # a margin around the boundary
    kept_texts = [t for t, k in zip(texts, keep.tolist()) if k]
    labels = (latent0[keep] > 0).long()
    table = sparse_probe(model, sae, kept_texts, labels, k_values=(1,), test_fraction=0.25, C=100.0, progress=False)
    one = table[table["inputs"] == "sae latents"].iloc[0]
    assert one["latents"] == [0] and one["accuracy"] >= 0.95
    assert table["inputs"].tolist() == ["sae latents", "activation"] and _attached(model) == 0
    with pytest.raises(InputError, match="d_sae"):
        sparse_probe(model, sae, kept_texts, labels, k_values=(9,), progress=False)
