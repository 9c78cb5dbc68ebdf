"""``PairedPrompts``, the one prompt-pair type of patching and circuits, its older call forms, and the one
gradient-capturing hook (``experiments.gradients``).

Expected values: the older call forms' own results (which the other patching and circuit tests check against
run_with_hooks loops, forward-mode derivatives and TransformerLens), and hand calculations for the gradients."""

import pytest
import torch

import workbench as wb
from experiments.circuits import edge_attribution_patching, faithfulness_curve
from experiments.gradients import capturing_gradients
from experiments.metrics import LogitDiff
from experiments.patching import PairedPrompts, attribution_patching, patch_heads, patched_run
from tests.unit.helpers import make_model

CLEAN = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(7))
CORRUPT = CLEAN.clone()
CORRUPT[:, 1] = (CLEAN[:, 1] + 5) % 61
ANSWERS, WRONGS = [3, 4], [8, 9]


@pytest.fixture(scope="module")
def model():
    return make_model("gqa_rotary_rms_swiglu")


def test_the_pairs_and_the_older_forms_give_the_same_results(model):
    pairs = PairedPrompts.from_prompts(model, CLEAN, CORRUPT, ANSWERS, WRONGS)
    assert pairs.answer_tokens.tolist() == ANSWERS and pairs.wrong_tokens.tolist() == WRONGS
    assert pairs.lengths.tolist() == [6, 6] and pairs.size == 2
    new, old = patch_heads(model, pairs, False), patch_heads(model, CLEAN, CORRUPT, ANSWERS, WRONGS, False)
    assert new.equals(old)
    keywords = patch_heads(model, clean_tokens=CLEAN, corrupt_tokens=CORRUPT, answer_token=ANSWERS,
                           wrong_token=WRONGS, progress=False)
    assert keywords.equals(old)
    assert attribution_patching(model, pairs, ["heads"]).equals(
        attribution_patching(model, CLEAN, CORRUPT, ANSWERS, WRONGS, sites=["heads"]))
    metric = LogitDiff(torch.tensor(ANSWERS), torch.tensor(WRONGS))
    scores = edge_attribution_patching(model, pairs)
    torch.testing.assert_close(scores.scores, edge_attribution_patching(model, CLEAN, CORRUPT, metric).scores,
                               rtol=0, atol=0)
    curve = faithfulness_curve(model, pairs, scores, [0, 5])
    assert curve.equals(faithfulness_curve(model, (CLEAN, CORRUPT), metric, scores, [0, 5]))
    assert curve.equals(faithfulness_curve(model, pairs, None, scores, [0, 5]))  # the older (dataset, metric) form
    torch.testing.assert_close(patched_run(model, pairs, "blocks.0.hook_resid_pre"), model(CLEAN), rtol=0, atol=1e-5)


def test_a_new_metric_replaces_the_pairs_own_and_bad_calls_are_refused_by_name(model):
    pairs = PairedPrompts.from_prompts(model, CLEAN, CORRUPT, ANSWERS, WRONGS)
    swapped = PairedPrompts.from_prompts(model, pairs, metric=LogitDiff(torch.tensor(WRONGS), torch.tensor(ANSWERS)))
    heads = patch_heads(model, pairs, False)
    torch.testing.assert_close(torch.tensor(patch_heads(model, swapped, False).delta.values),
                               -torch.tensor(heads.delta.values), rtol=0, atol=1e-5)  # the difference, reversed
    with pytest.raises(wb.InputError, match="patch_heads needs a metric"):
        patch_heads(model, PairedPrompts.from_prompts(model, CLEAN, CORRUPT), False)
    with pytest.raises(wb.InputError, match="holds its own corrupted prompts"):
        PairedPrompts.from_prompts(model, pairs, CORRUPT)
    with pytest.raises(wb.InputError, match="corrupt_tokens is given twice"):
        patch_heads(model, CLEAN, CORRUPT, corrupt_tokens=CORRUPT)
    with pytest.raises(wb.InputError, match="pass corrupted prompts"):
        edge_attribution_patching(model, CLEAN)


def test_captured_gradients_by_hand_and_cut_paths(model):
    for p in model.parameters():
        p.requires_grad_(False)  # frozen weights: the captured points become leaves
    try:
        weights = torch.randn(1, 6, model.cfg.d_model, generator=torch.Generator().manual_seed(1))
        names = ["blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]
        with capturing_gradients(model, names) as capture:
            resid = model(CLEAN[:1], stop_at_layer=2)
            through = capture.gradients((resid * weights).sum())
        torch.testing.assert_close(through[names[1]], weights)  # d (resid . w) / d resid = w
        assert through[names[0]].abs().sum() > 0
        with capturing_gradients(model, names, cut=True) as capture:
            resid = model(CLEAN[:1], stop_at_layer=2)
            cut = capture.gradients((resid * weights).sum())
        torch.testing.assert_close(cut[names[1]], weights)
        assert cut[names[0]].abs().sum() == 0  # every path from resid_pre runs through resid_post, which is cut
        assert model.attached_hooks() == {}
    finally:
        for p in model.parameters():
            p.requires_grad_(True)


def test_captured_gradients_cut_only_at_named_points(model):
    weights = torch.randn(1, 6, model.cfg.d_model, generator=torch.Generator().manual_seed(2))
    names = ["blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]
    with capturing_gradients(model, names) as capture:
        through = capture.gradients((model(CLEAN[:1], stop_at_layer=2) * weights).sum())
    with capturing_gradients(model, names, cut=[names[1]]) as capture:
        after_cut = capture.gradients((model(CLEAN[:1], stop_at_layer=2) * weights).sum())
    torch.testing.assert_close(after_cut[names[1]], weights)  # d (resid . w) / d resid = w
    assert after_cut[names[0]].abs().sum() == 0  # its only path runs through the cut point
    with capturing_gradients(model, names, cut=names[0]) as capture:
        before_cut = capture.gradients((model(CLEAN[:1], stop_at_layer=2) * weights).sum())
    torch.testing.assert_close(before_cut[names[0]], through[names[0]])  # a leaf keeps every path after it
    torch.testing.assert_close(before_cut[names[1]], weights)
    with pytest.raises(wb.InputError, match="blocks.0.hook_embed.*not among the captured points"):
        capturing_gradients(model, names, cut=["blocks.0.hook_embed"]).__enter__()
    assert model.attached_hooks() == {}
