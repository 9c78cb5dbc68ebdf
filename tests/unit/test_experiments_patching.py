"""Activation patching and attribution patching.

References: the clean run's own logits, positions where clean and corrupt agree (patching them
cannot change anything), plain ``run_with_hooks`` loops written here, and
forward-mode derivatives (torch.func.jvp) for the attribution (a first-order estimate must equal the derivative).
"""

import pytest
import torch

import workbench as wb
from experiments.patching import (attribution_patching, logit_diff_metric, patch_attn_mlp, patch_heads,
                                  patch_residual, patched_run)
from experiments.plots.patching import patching_heatmap
from tests.unit.helpers import make_model

ANSWER, WRONG = 3, 7


def pair(P=8, changed=2, seed=0):
    clean = torch.randint(0, 61, (2, P), generator=torch.Generator().manual_seed(seed))
    corrupt = clean.clone()
    corrupt[:, changed] = (clean[:, changed] + 11) % 61
    return clean, corrupt


def logit_diff(logits):
    return float((logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean().detach())


@pytest.mark.parametrize("variant", ["mha_learned_ln", "gqa_rotary_rms_swiglu", "alibi_gelu_new"])
def test_patching_the_whole_residual_at_layer_0_reproduces_the_clean_logits(variant):
    model = make_model(variant)
    clean, corrupt = pair()
    patched = patched_run(model, clean, corrupt, "blocks.0.hook_resid_pre")
    torch.testing.assert_close(patched, model(clean), rtol=0, atol=1e-5)
    assert not torch.allclose(model(corrupt), model(clean), atol=1e-3)


def test_patch_residual_at_layer_0_restores_only_the_changed_position():
    model = make_model("gqa_rotary_rms_swiglu")
    clean, corrupt = pair(changed=2)
    df = patch_residual(model, clean, corrupt, ANSWER, WRONG, progress=False)
    assert list(df.columns[:3]) == ["layer", "position", "metric"]
    assert len(df) == 2 * 8
    layer0 = df[df.layer == 0].set_index("position")
    assert layer0.loc[2, "normalized"] == pytest.approx(1.0, abs=1e-4)
    assert layer0.drop(index=2)["normalized"].abs().max() < 1e-4
    assert df.attrs["clean_metric"] == pytest.approx(logit_diff(model(clean)), abs=1e-5)
    assert df.attrs["corrupt_metric"] == pytest.approx(logit_diff(model(corrupt)), abs=1e-5)


def hooked_loop(model, clean, corrupt, sites):
    """sites: (hook_name, position, head) -> logit diff of the corrupt run with that slice from the clean run."""
    names = {name for name, _, _ in sites}
    _, cache = model.run_with_cache(clean, names_filter=lambda n: n in names)
    out = []
    for name, position, head in sites:
        def hook(act, hook, name=name, position=position, head=head):
            act = act.clone()
            if head is not None:
                act[:, :, head] = cache[name][:, :, head]
            else:
                act[:, position] = cache[name][:, position]
            return act
        out.append(logit_diff(model.run_with_hooks(corrupt, fwd_hooks=[(name, hook)])))
    return torch.tensor(out)


@pytest.mark.parametrize("variant", ["mha_learned_ln", "moe_gqa"])
def test_batched_patching_equals_a_loop(variant):
    model = make_model(variant)
    clean, corrupt = pair(P=6, changed=1, seed=1)
    P, L, H = 6, 2, 4
    resid = patch_residual(model, clean, corrupt, ANSWER, WRONG, progress=False)
    expected = hooked_loop(model, clean, corrupt, [(f"blocks.{l}.hook_resid_pre", p, None) for l in range(L) for p in range(P)])
    torch.testing.assert_close(torch.tensor(resid.metric.values), expected, rtol=0, atol=1e-5)
    layers = patch_attn_mlp(model, clean, corrupt, ANSWER, WRONG, progress=False)
    assert list(layers.columns[:4]) == ["component", "layer", "position", "metric"]
    expected = hooked_loop(model, clean, corrupt, [(f"blocks.{l}.hook_{c}_out", p, None)
                                                   for c in ("attn", "mlp") for l in range(L) for p in range(P)])
    torch.testing.assert_close(torch.tensor(layers.metric.values), expected, rtol=0, atol=1e-5)
    heads = patch_heads(model, clean, corrupt, ANSWER, WRONG, progress=False)
    expected = hooked_loop(model, clean, corrupt, [(f"blocks.{l}.attn.hook_z", None, h) for l in range(L) for h in range(H)])
    torch.testing.assert_close(torch.tensor(heads.metric.values), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(heads.delta.values), expected - logit_diff(model(corrupt)), rtol=0, atol=1e-5)


def directional_derivative(model, clean, corrupt, name, position=None, head=None):
    """d/dt at t=0 of the logit diff when the corrupt activation moves by t * (clean - corrupt) at one
    slice, by forward-mode differentiation (torch.func.jvp): independent of the backward pass under test."""
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean, names_filter=lambda n: n == name)
        _, corrupt_cache = model.run_with_cache(corrupt, names_filter=lambda n: n == name)
    diff = clean_cache[name] - corrupt_cache[name]
    mask = torch.zeros_like(diff)
    if head is not None:
        mask[:, :, head] = 1
    else:
        mask[:, position] = 1

    def at(t):
        logits = model.run_with_hooks(corrupt, fwd_hooks=[(name, lambda a, hook: a + t * diff * mask)])
        return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()

    with torch.no_grad():
        _, derivative = torch.func.jvp(at, (torch.tensor(0.0),), (torch.tensor(1.0),))
    return derivative.item()


def test_attribution_patching_is_the_first_order_estimate():
    model = make_model("gqa_rotary_rms_swiglu", attn_impl="eager")  # forward-mode AD has no sdpa rule
    clean, corrupt = pair(P=6, changed=2, seed=2)
    df = attribution_patching(model, clean, corrupt, ANSWER, WRONG)
    assert "approximation" in df.attrs["method"]
    assert set(df.site) == {"resid", "attn", "mlp", "heads"}
    assert list(df.columns) == ["site", "layer", "position", "head", "attribution"]
    checks = [("heads", 1, -1, 2, "blocks.1.attn.hook_z"), ("heads", 0, -1, 0, "blocks.0.attn.hook_z"),
              ("resid", 1, 3, -1, "blocks.1.hook_resid_pre"), ("mlp", 0, 2, -1, "blocks.0.hook_mlp_out"),
              ("attn", 1, 5, -1, "blocks.1.hook_attn_out")]
    for site, layer, position, head, name in checks:
        row = df[(df.site == site) & (df.layer == layer) & (df.position == position) & (df["head"] == head)]
        expected = directional_derivative(model, clean, corrupt, name, None if position < 0 else position,
                                          None if head < 0 else head)
        assert row.attribution.item() == pytest.approx(expected, rel=1e-4, abs=1e-7), (site, layer, position, head)
    # Positions where clean and corrupt agree before any mixing have zero attribution at layer 0.
    resid0 = df[(df.site == "resid") & (df.layer == 0)]
    assert resid0[resid0.position != 2].attribution.abs().max() == 0


def test_attribution_patching_works_with_frozen_weights():
    model = make_model("mha_learned_ln")
    for p in model.parameters():
        p.requires_grad_(False)
    clean, corrupt = pair()
    df = attribution_patching(model, clean, corrupt, ANSWER, WRONG, sites=["heads"])
    assert len(df) == 8 and df.attribution.abs().sum() > 0


def test_logit_diff_metric_per_batch_item_tokens():
    logits = torch.zeros(2, 3, 5)
    logits[0, -1, 1], logits[1, -1, 2] = 4.0, 1.0
    metric = logit_diff_metric(torch.tensor([1, 2]), torch.tensor([0, 0]))
    assert metric(logits, None).item() == pytest.approx(2.5)


@pytest.mark.parametrize("position", [2, -1])
def test_a_one_position_metric_scores_edits_like_a_loop(position):
    # score_edits unembeds only the position a PositionMetric reads; the same metric wrapped in
    # a plain function gets every position's logits. Both must equal a run_with_hooks loop.
    from experiments._batched import Edit, score_edits, unedited_run
    from experiments.metrics import PromptBatch, as_metric
    from experiments.sites import Site
    model = make_model("gqa_rotary_rms_swiglu")
    tokens = pair(P=6)[1]
    batch = PromptBatch(tokens)
    metric = logit_diff_metric(ANSWER, torch.tensor([WRONG, 0]), position=position)
    kill = lambda h: (lambda z, hook=None: z.index_fill(2, torch.tensor([h]), 0))
    heads = [(l, h) for l in range(2) for h in range(4)]
    edits = [Edit(Site(f"blocks.{l}.attn.hook_z", index=h)) for l, h in heads]
    _, resid_pre, _ = unedited_run(model, batch, metric)
    with torch.no_grad():
        expected = torch.tensor([float(metric(model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{l}.attn.hook_z", kill(h))]),
                                              tokens)) for l, h in heads])
    torch.testing.assert_close(score_edits(model, resid_pre, batch, edits, metric).mean(1), expected, rtol=0, atol=1e-5)
    as_function = as_metric(lambda logits, tokens: metric(logits, tokens))
    torch.testing.assert_close(score_edits(model, resid_pre, batch, edits, as_function)[:, 0], expected, rtol=0, atol=1e-5)


def test_heatmaps_and_errors():
    model = make_model("mha_learned_ln")
    clean, corrupt = pair(P=5)
    for df in (patch_residual(model, clean, corrupt, ANSWER, WRONG, progress=False),
               patch_attn_mlp(model, clean, corrupt, ANSWER, WRONG, progress=False),
               patch_heads(model, clean, corrupt, ANSWER, WRONG, progress=False),
               attribution_patching(model, clean, corrupt, ANSWER, WRONG)):
        fig = patching_heatmap(df, "title")
        assert fig.data and fig.layout.title.text == "title"
    with pytest.raises(wb.InputError, match="2 clean prompts but 1 corrupted"):
        patch_residual(model, clean, corrupt[:1], ANSWER, WRONG, progress=False)
    with pytest.raises(wb.InputError, match="unknown attribution site"):
        attribution_patching(model, clean, corrupt, ANSWER, WRONG, sites=["neurons"])
