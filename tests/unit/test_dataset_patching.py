"""Patching and head sweeps over padded batches: a batch of prompts of different lengths gives the mean
of the single-prompt results, and per-prompt values equal each prompt run alone (the expected values
are the unpadded single-prompt runs of the same functions, which the padding-free tests elsewhere check
against run_with_hooks loops and TransformerLens)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import workbench as wb
from experiments.ablation import head_sweep
from experiments.metrics import LogitDiff, PromptBatch, TokenProbability, as_metric, token_ids
from experiments.patching import attribution_patching, patch_attn_mlp, patch_heads, patch_residual
from tests.unit.test_padding import make_model, padded

LENGTHS = (4, 7, 9)
ANSWERS, WRONGS = [11, 12, 13], [21, 22, 23]
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return make_model("rotary").set_attn_impl("sdpa")


def prompt_pairs(seed: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    clean = [torch.randint(3, 50, (n,), generator=generator) for n in LENGTHS]
    corrupt = [row.clone() for row in clean]
    for row in corrupt:
        row[-2] = (row[-2] + 17) % 47 + 3  # near the end: within the sliding window of the answer position
    return clean, corrupt


def batched(side: str):
    clean, corrupt = prompt_pairs()
    (clean_BP, clean_mask), (corrupt_BP, corrupt_mask) = padded(clean, side), padded(corrupt, side)
    return dict(clean_tokens=clean_BP, corrupt_tokens=corrupt_BP, clean_mask=clean_mask, corrupt_mask=corrupt_mask)


def single_runs(model, function, **kwargs) -> list[pd.DataFrame]:
    clean, corrupt = prompt_pairs()
    return [function(model, c[None], k[None], answer, wrong, **kwargs)
            for c, k, answer, wrong in zip(clean, corrupt, ANSWERS, WRONGS)]


@pytest.mark.parametrize("side", ["right", "left"])
def test_head_patching_of_a_padded_batch_is_the_mean_of_single_prompts(model, side):
    singles = single_runs(model, patch_heads, progress=False)
    batch = patch_heads(model, answer_token=ANSWERS, wrong_token=WRONGS, progress=False, **batched(side))
    mean_metric = sum(df.metric.values for df in singles) / len(singles)
    assert abs(batch.metric.values - mean_metric).max() < ATOL
    assert batch.attrs["clean_metric"] == pytest.approx(sum(df.attrs["clean_metric"] for df in singles) / 3, abs=ATOL)
    per_prompt = patch_heads(model, answer_token=ANSWERS, wrong_token=WRONGS, progress=False, per_prompt=True,
                             **batched(side))
    for index, single in enumerate(singles):
        rows = per_prompt[per_prompt.prompt == index]
        for column in ("metric", "delta", "normalized"):
            assert abs(rows[column].values - single[column].values).max() < ATOL, column


def test_position_patching_per_prompt_equals_each_prompt_alone_at_its_real_positions(model):
    # Right padding keeps each prompt's positions; at a pad position of a shorter row the patch
    # changes nothing (pads are invisible), so that row keeps its corrupted value there.
    singles = single_runs(model, patch_residual, progress=False)
    per_prompt = patch_residual(model, answer_token=ANSWERS, wrong_token=WRONGS, progress=False,
                                per_prompt=True, **batched("right"))
    for index, (single, n) in enumerate(zip(singles, LENGTHS)):
        rows = per_prompt[per_prompt.prompt == index]
        real = rows[rows.position < n]
        assert abs(real.metric.values - single.metric.values).max() < ATOL
        pads = rows[rows.position >= n]
        assert len(pads) == model.cfg.n_layers * (max(LENGTHS) - n)
        assert all(abs(pads.metric.values - single.attrs["corrupt_metric"]) < ATOL)
    attn_mlp = patch_attn_mlp(model, answer_token=ANSWERS, wrong_token=WRONGS, progress=False,
                              per_prompt=True, **batched("right"))
    single = single_runs(model, patch_attn_mlp, progress=False)[0]
    rows = attn_mlp[(attn_mlp.prompt == 0) & (attn_mlp.position < LENGTHS[0])]
    assert abs(rows.metric.values - single.metric.values).max() < ATOL


@pytest.mark.parametrize("side", ["right", "left"])
def test_attribution_patching_of_a_batch_is_the_mean_and_per_prompt_is_each_alone(model, side):
    singles = single_runs(model, attribution_patching, sites=["heads"])
    batch = attribution_patching(model, answer_token=ANSWERS, wrong_token=WRONGS, sites=["heads"],
                                 **batched(side))
    assert abs(batch.attribution.values - sum(df.attribution.values for df in singles) / 3).max() < ATOL
    per_prompt = attribution_patching(model, answer_token=ANSWERS, wrong_token=WRONGS, sites=["heads"],
                                      per_prompt=True, **batched(side))
    for index, single in enumerate(singles):
        assert abs(per_prompt[per_prompt.prompt == index].attribution.values - single.attribution.values).max() < ATOL


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("metric_name", ["loss", "logit_diff", "probability", "callable"])
def test_head_sweep_of_a_padded_batch_is_the_mean_of_single_prompts(model, side, metric_name):
    clean, _ = prompt_pairs()
    tokens, mask = padded(clean, side)

    def metric_for(answers, wrongs):
        return {"loss": "loss",
                "logit_diff": LogitDiff(torch.tensor(answers), torch.tensor(wrongs)),
                "probability": TokenProbability(torch.tensor(answers)),
                # a user's function of each row's last-token logits, one value per row
                "callable": as_metric(lambda logits_BV, tokens: logits_BV.logsumexp(-1), position="last")}[metric_name]

    singles = [head_sweep(model, row[None], metric_for([answer], [wrong]), progress=False)
               for row, answer, wrong in zip(clean, ANSWERS, WRONGS)]
    sweep = head_sweep(model, tokens, metric_for(ANSWERS, WRONGS), attention_mask=mask, progress=False,
                       tokens_per_pass=40)
    assert abs(sweep.metric.values - sum(df.metric.values for df in singles) / 3).max() < ATOL
    per_prompt = head_sweep(model, tokens, metric_for(ANSWERS, WRONGS), attention_mask=mask, progress=False,
                            per_prompt=True)
    for index, single in enumerate(singles):
        rows = per_prompt[per_prompt.prompt == index]
        assert abs(rows.metric.values - single.metric.values).max() < ATOL
        assert abs(rows.delta.values - single.delta.values).max() < ATOL


def test_each_row_reads_its_own_last_real_token():
    tokens, mask = padded(prompt_pairs()[0], "right")
    batch = PromptBatch(tokens, mask.bool())
    assert batch.last_positions.tolist() == [n - 1 for n in LENGTHS]  # by hand: right padding
    left = PromptBatch(*[t if i == 0 else t.bool() for i, t in enumerate(padded(prompt_pairs()[0], "left"))])
    assert left.last_positions.tolist() == [max(LENGTHS) - 1] * 3
    logits = torch.zeros(3, max(LENGTHS), 50)
    for row, n in enumerate(LENGTHS):
        logits[row, n - 1, ANSWERS[row]] = float(row + 1)  # only each row's last real position holds the answer
    assert LogitDiff(torch.tensor(ANSWERS), torch.tensor(WRONGS)).values(logits, batch).tolist() == [1.0, 2.0, 3.0]


def test_text_prompts_of_different_lengths_pad_themselves_and_answers_may_be_text(model):
    clean = ["w5 w6 w7 w8", "w9 w10", "w11 w12 w13"]
    corrupt = ["w5 w16 w7 w8", "w9 w20", "w11 w22 w13"]
    df = patch_heads(model, clean, corrupt, ["w30", "w31", "w32"], "w40", progress=False, per_prompt=True)
    for index, (c, k, answer) in enumerate(zip(clean, corrupt, ["w30", "w31", "w32"])):
        alone = patch_heads(model, c, k, answer, "w40", progress=False)
        assert abs(df[df.prompt == index].metric.values - alone.metric.values).max() < ATOL


def test_bad_dataset_input_is_refused_by_name(model):
    tokens, mask = padded(prompt_pairs()[0], "right")
    with pytest.raises(wb.InputError, match="answer_token has 2 entries but there are 3 prompts"):
        patch_heads(model, tokens, tokens, [11, 12], 21, progress=False, clean_mask=mask, corrupt_mask=mask)
    with pytest.raises(wb.InputError, match="wrong_token has 4 entries"):
        token_ids(model, [1, 2, 3, 4], 3, "wrong_token")
    with pytest.raises(wb.InputError, match="attention_mask has shape"):
        head_sweep(model, tokens, attention_mask=mask[:, :-1], progress=False)
    with pytest.raises(wb.InputError, match="all padding"):
        bad = mask.clone()
        bad[1] = 0
        head_sweep(model, tokens, attention_mask=bad, progress=False)
    with pytest.raises(wb.InputError, match="one value for the whole batch"):
        head_sweep(model, tokens, lambda logits, tokens: logits.mean(), attention_mask=mask, per_prompt=True,
                   progress=False)
    with pytest.raises(wb.InputError, match="position"):
        head_sweep(model, tokens, TokenProbability(torch.tensor([1])), position="first", attention_mask=mask,
                   progress=False)
