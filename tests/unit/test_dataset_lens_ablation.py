"""Ablation, logit lens and direct logit attribution over padded batches of prompts of different lengths.

References: each prompt run ALONE (unpadded) through the same function. A batch's value must be
the mean of its prompts' values and its per-prompt values must be theirs, under right and left
padding, for a GQA + rotary + RMSNorm model and a learned-positions + LayerNorm model (with
biases). The mean reference is checked against a mean written out here from each reference
prompt run alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

import workbench as wb
from experiments.ablation import (AblationTarget, ablation_effect, ablation_hooks, mean_reference,
                                  per_token_loss_change, run_ablated, top_predictions_change)
from experiments.datasets import mean_activations
from experiments.lens import (direct_logit_attribution, logit_lens, logit_lens_logits, logit_lens_metric,
                              residual_snapshots)
from experiments.plots.lens import logit_lens_figure
from experiments.metrics import Loss, TokenProbability, logit_diff, prompt_batch
from tests.unit.test_padding import padded as pad_rows
from workbench.tokenizer import SpecialTokens, Tokenizer

VOCAB = 50
LENGTHS = (5, 8, 11)  # three prompt lengths: a batch of them pads
TOL = 1e-5
MODELS = {
    "gqa_rotary": dict(n_key_value_heads=2, positional="rotary", normalization="RMS", gated_mlp=True, act_fn="silu"),
    "learned_ln": dict(positional="learned", normalization="LN", act_fn="gelu", attn_bias=True, mlp_bias=True),
}
TARGETS = [AblationTarget("head", 0, 1), AblationTarget("head", 1, 4), AblationTarget("mlp_layer", 0),
           AblationTarget("neuron", 1, 3), AblationTarget("attn_layer", 1)]
ANSWERS, WRONGS = ["w5", 9, 12], [4, "w20", 30]  # one answer and one wrong token per prompt, ids or texts


def make_model(kind: str) -> wb.Decoder:
    torch.manual_seed(0)
    cfg = wb.ModelConfig(n_layers=2, d_model=48, n_heads=6, d_vocab=VOCAB, n_ctx=32, **MODELS[kind])
    words = BackendTokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = Tokenizer(words, SpecialTokens(bos_token="w1", eos_token="w2", pad_token="w0"))
    model = wb.Decoder(cfg, tokenizer=tokenizer)
    with torch.no_grad():  # non-trivial norm gains and biases
        for name, param in model.named_parameters():
            if name.endswith((".w", ".b")) or ".b_" in name or "._b_" in name:
                param.normal_(1.0 if name.endswith(".w") else 0.0, 0.1)
    return model.eval()


def random_rows(lengths, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths]


def padded(rows: list[torch.Tensor], side: str, pad: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded with ``pad`` (a real word: only the mask hides it) and their mask."""
    return pad_rows(rows, side, pad)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return make_model(request.param)


@pytest.fixture(scope="module")
def rows():
    return random_rows(LENGTHS, seed=1)


@pytest.fixture(params=["right", "left"])
def side(request):
    return request.param


@pytest.fixture(scope="module")
def reference():
    """A fixed, unpadded reference longer than every prompt."""
    return torch.randint(3, VOCAB, (4, 12), generator=torch.Generator().manual_seed(2))


def metrics_for(model, rows: int, index=None):
    """(name, metric) pairs for a batch of ``rows`` prompts, or for prompt ``index`` alone."""
    pick = (lambda items: items) if index is None else (lambda items: items[index])
    return [("loss", "loss"),
            ("logit_diff", logit_diff(model, pick(ANSWERS), pick(WRONGS), rows)),
            ("log_prob", TokenProbability(torch.tensor(pick([6, 17, 41])).reshape(-1), log=True))]


def close(actual, expected, tol=TOL):
    as_tensor = lambda x: torch.as_tensor(np.array(x, dtype=np.float64))  # noqa: E731
    torch.testing.assert_close(as_tensor(actual), as_tensor(expected), rtol=0, atol=tol)


# ---- ablation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["zero", "mean"])
def test_ablation_effect_of_a_padded_batch_is_the_mean_of_each_prompt_alone(model, rows, side, reference, method):
    tokens, mask = padded(rows, side)
    ref = None if method == "zero" else reference
    for position, (name, metric) in enumerate(metrics_for(model, len(rows))):
        batched = ablation_effect(model, tokens, TARGETS, metric, method, ref, attention_mask=mask)
        per_prompt = ablation_effect(model, tokens, TARGETS, metric, method, ref, attention_mask=mask, per_prompt=True)
        alone = [ablation_effect(model, row[None], TARGETS, metrics_for(model, 1, i)[position][1], method, ref)
                 for i, row in enumerate(rows)]
        assert list(batched.columns) == ["clean", "ablated", "delta"] and len(batched) == 1, name
        assert list(per_prompt.columns) == ["prompt", "clean", "ablated", "delta"], name
        assert per_prompt.prompt.tolist() == [0, 1, 2]
        for column in ("clean", "ablated", "delta"):
            expected = [df[column].item() for df in alone]
            close(per_prompt[column].values, expected)
            close(batched[column].item(), sum(expected) / len(expected))
        assert per_prompt.delta.abs().max() > 1e-4, name  # the ablation changed something


def test_ablation_effect_matches_a_hand_written_hook_and_the_models_metric(model, rows, side):
    tokens, mask = padded(rows, side)
    metric = logit_diff(model, ANSWERS, WRONGS, len(rows))
    batch = prompt_batch(model, tokens, mask)
    zero_head = lambda z, hook: torch.cat([z[:, :, :1], 0 * z[:, :, 1:2], z[:, :, 2:]], dim=2)  # noqa: E731
    with torch.no_grad():
        clean = metric.values(model(tokens, attention_mask=mask), batch)
        ablated = metric.values(model.run_with_hooks(tokens, attention_mask=mask,
                                                     fwd_hooks=[("blocks.0.attn.hook_z", zero_head)]), batch)
    df = ablation_effect(model, tokens, [AblationTarget("head", 0, 1)], metric, attention_mask=mask, per_prompt=True)
    close(df.clean.values, clean)
    close(df.ablated.values, ablated)
    close(df.attrs["clean_metric_per_prompt"], clean)


def test_resample_ablation_pairs_each_prompt_with_its_reference_row(model, rows, side):
    tokens, mask = padded(rows, side)
    ref_rows = random_rows((7, 11, 12), seed=3)  # each at least as long as its prompt, padded the other way
    ref_tokens, ref_mask = padded(ref_rows, "left" if side == "right" else "right", pad=9)
    df = ablation_effect(model, tokens, TARGETS[:3], "loss", "resample", ref_tokens, per_prompt=True,
                         attention_mask=mask, reference_mask=ref_mask)
    alone = [ablation_effect(model, row[None], TARGETS[:3], "loss", "resample", ref[None])
             for row, ref in zip(rows, ref_rows)]
    close(df.ablated.values, [a.ablated.item() for a in alone])
    # Without a reference each prompt takes the next one's activations: a shorter next prompt cannot serve.
    with pytest.raises(wb.InputError, match="fewer than the input's"):
        ablation_effect(model, tokens, TARGETS[:1], "loss", "resample", attention_mask=mask)


def hand_mean(model, ref_rows, name):
    """The mean at each position over the reference prompts long enough to have it, each run alone."""
    width = max(len(row) for row in ref_rows)
    acts = []
    with torch.no_grad():
        for row in ref_rows:
            _, cache = model.run_with_cache(row[None], names_filter=name)
            acts.append(cache[name][0])
    total = torch.zeros(width, *acts[0].shape[1:], dtype=torch.float64)
    count = torch.zeros(width, dtype=torch.float64)
    for act in acts:
        total[:len(act)] += act.double()
        count[:len(act)] += 1
    return (total / count.view(-1, *[1] * (total.ndim - 1))).float()


def test_mean_reference_of_a_padded_reference_is_the_masked_mean(model, rows, side):
    ref_rows = random_rows((4, 12, 9, 12), seed=4)
    ref_tokens, ref_mask = padded(ref_rows, side, pad=11)
    names = sorted({t.hook_name for t in TARGETS})
    means = mean_reference(model, ref_tokens, TARGETS, reference_mask=ref_mask, batch_size=3)
    assert sorted(means) == names
    for name in names:
        close(means[name][0], hand_mean(model, ref_rows, name))
    # Right-padded, datasets.mean_activations gives the same reference; both serve reference_means.
    right_tokens, right_mask = padded(ref_rows, "right", pad=11)
    for name, mean in mean_activations(model, right_tokens, names, batch_size=2, attention_mask=right_mask).items():
        close(mean, means[name])


def test_mean_ablation_writes_the_masked_mean_at_each_prompts_own_positions(model, rows, side):
    ref_rows = random_rows((4, 12, 9, 12), seed=4)
    ref_tokens, ref_mask = padded(ref_rows, "left" if side == "right" else "right", pad=11)
    tokens, mask = padded(rows, side)
    name, head = "blocks.1.attn.hook_z", 4
    expected_mean = hand_mean(model, ref_rows, name)[:, head]  # [pos, d_head]
    means = mean_reference(model, ref_tokens, TARGETS, reference_mask=ref_mask)
    seen = {}
    hooks = ablation_hooks(model, [AblationTarget("head", 1, head)], "mean", reference_means=means, attention_mask=mask)
    with torch.no_grad():
        model.run_with_hooks(tokens, attention_mask=mask,
                             fwd_hooks=hooks + [(name, lambda act, hook: seen.update(z=act.clone()))])
    for b, row in enumerate(rows):
        close(seen["z"][b][mask[b].bool()][:, head], expected_mean[:len(row)])
    # The precomputed means, the reference prompts themselves and a hand-written hook on each prompt alone agree.
    from_means = ablation_effect(model, tokens, TARGETS, "loss", "mean", attention_mask=mask, reference_means=means,
                                 per_prompt=True)
    from_tokens = ablation_effect(model, tokens, TARGETS, "loss", "mean", ref_tokens, attention_mask=mask,
                                  reference_mask=ref_mask, per_prompt=True)
    close(from_means.ablated.values, from_tokens.ablated.values)
    for b, row in enumerate(rows):
        hand = {t.hook_name: hand_mean(model, ref_rows, t.hook_name)[None, :len(row)] for t in TARGETS}
        hooks = [(t.hook_name, lambda act, hook, t=t: t.site.write(act.clone(), hand[t.hook_name])) for t in TARGETS]
        with torch.no_grad():
            loss = model.run_with_hooks(row[None], return_type="loss", fwd_hooks=hooks)
        close(from_means.ablated[b], loss.item())


def test_mean_ablation_without_a_reference_averages_the_batch_without_its_pads(model, rows, side):
    tokens, mask = padded(rows, side)
    name = "blocks.0.hook_mlp_out"
    expected = hand_mean(model, rows, name)
    seen = {}
    hooks = [(name, lambda act, hook: seen.update(out=act.clone()))]
    with torch.no_grad():
        logits = run_ablated(model, tokens, [AblationTarget("mlp_layer", 0)], "mean", attention_mask=mask)
        model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=ablation_hooks(
            model, [AblationTarget("mlp_layer", 0)], "mean", tokens, reference_mask=mask, attention_mask=mask) + hooks)
    for b, row in enumerate(rows):
        close(seen["out"][b][mask[b].bool()], expected[:len(row)])
    assert logits.shape == (*tokens.shape, VOCAB)


def test_per_token_loss_and_top_predictions_of_a_padded_row_equal_the_prompt_alone(model, rows, side):
    tokens, mask = padded(rows, side)
    target = [AblationTarget("head", 1, 2)]
    for index, row in enumerate(rows):
        batched = per_token_loss_change(model, tokens, target, row=index, attention_mask=mask)
        alone = per_token_loss_change(model, row[None], target)
        assert batched.position.tolist() == alone.position.tolist() == list(range(1, len(row)))
        assert batched.token.tolist() == alone.token.tolist()
        for column in ("clean_loss", "ablated_loss", "delta"):
            close(batched[column].values, alone[column].values)
        for position in ("last", 2, -3):
            top = top_predictions_change(model, tokens, target, k=4, position=position, row=index, attention_mask=mask)
            top_alone = top_predictions_change(model, row[None], target, k=4, position=position)
            assert top.clean_token_id.tolist() == top_alone.clean_token_id.tolist()
            close(top.ablated_prob.values, top_alone.ablated_prob.values)
    with pytest.raises(wb.InputError, match="row=3 is outside"):
        per_token_loss_change(model, tokens, target, row=3, attention_mask=mask)
    with pytest.raises(wb.InputError, match="position must be 'last' or an index"):
        top_predictions_change(model, tokens, target, position=5, row=0, attention_mask=mask)


# ---- logit lens ----------------------------------------------------------------------------------
def test_logit_lens_of_a_padded_row_drops_its_pads(model, rows, side):
    tokens, mask = padded(rows, side)
    for index, row in enumerate(rows):
        close(residual_snapshots(model, tokens, index, attention_mask=mask), residual_snapshots(model, row[None]))
        close(logit_lens_logits(model, tokens, index, attention_mask=mask), logit_lens_logits(model, row))
        df = logit_lens(model, tokens, 3, index, attention_mask=mask)
        alone = logit_lens(model, row[None], 3)
        assert df[["layer", "position", "rank", "token_id"]].values.tolist() == \
            alone[["layer", "position", "rank", "token_id"]].values.tolist()
        close(df.prob.values, alone.prob.values)
        labels = model.to_str_tokens(tokens)
        figure = logit_lens_figure(df, labels, index, mask)
        assert len(figure.data[0].x) == len(row)


@pytest.mark.parametrize("metric_index", [0, 1, 2])
def test_logit_lens_metric_is_the_mean_of_each_prompt_alone(model, rows, side, metric_index):
    tokens, mask = padded(rows, side)
    name, metric = metrics_for(model, len(rows))[metric_index]
    df = logit_lens_metric(model, tokens, metric, attention_mask=mask)
    per_prompt = logit_lens_metric(model, tokens, metric, attention_mask=mask, per_prompt=True)
    alone = [logit_lens_metric(model, row[None], metrics_for(model, 1, i)[metric_index][1]) for i, row in enumerate(rows)]
    L = model.cfg.n_layers
    assert list(df.columns) == ["layer", "metric"] and df.layer.tolist() == list(range(L + 1))
    assert list(per_prompt.columns) == ["layer", "prompt", "metric"]
    expected_TB = torch.tensor(np.stack([a.metric.values for a in alone])).T  # [layer, prompt]
    close(per_prompt.metric.values, expected_TB.flatten())
    close(df.metric.values, expected_TB.mean(1))
    # The last snapshot is the model's own metric.
    batch = prompt_batch(model, tokens, mask)
    with torch.no_grad():
        own = (Loss() if metric == "loss" else metric).values(model(tokens, attention_mask=mask), batch)
    close(df.metric.iloc[-1], own.mean())


def test_logit_lens_metric_unembeds_only_the_positions_it_reads(model, rows, side, monkeypatch):
    tokens, mask = padded(rows, side)
    shapes = []
    original = model.logits_from_resid
    monkeypatch.setattr(model, "logits_from_resid", lambda resid: shapes.append(tuple(resid.shape)) or original(resid))
    logit_lens_metric(model, tokens, logit_diff(model, ANSWERS, WRONGS, 3), attention_mask=mask)
    assert shapes == [(3, 1, model.cfg.d_model)] * (model.cfg.n_layers + 1)


# ---- direct logit attribution ------------------------------------------------------------------
@pytest.mark.parametrize("baseline", [None, WRONGS])
def test_direct_logit_attribution_is_the_mean_of_each_prompt_alone(model, rows, side, baseline):
    tokens, mask = padded(rows, side)
    df = direct_logit_attribution(model, tokens, ANSWERS, baseline, attention_mask=mask)
    per_prompt = direct_logit_attribution(model, tokens, ANSWERS, baseline, attention_mask=mask, per_prompt=True)
    alone = [direct_logit_attribution(model, row[None], ANSWERS[i], None if baseline is None else baseline[i])
             for i, row in enumerate(rows)]
    keys = ["component", "layer", "head"]
    assert df[keys].values.tolist() == alone[0][keys].values.tolist()
    expected_nB = torch.tensor(np.stack([a.attribution.values for a in alone])).T  # [component, prompt]
    close(df.attribution.values, expected_nB.mean(1))
    assert list(per_prompt.columns) == keys + ["prompt", "attribution"]
    close(per_prompt.attribution.values, expected_nB.flatten())
    diffs = [a.attrs["logit_diff"] for a in alone]
    close(df.attrs["logit_diff_per_prompt"], diffs)
    close(df.attrs["logit_diff"], sum(diffs) / 3)
    close(df.attribution.sum(), df.attrs["logit_diff"], tol=1e-4)  # the shares still sum to the (mean) difference


# ---- bad input -----------------------------------------------------------------------------------
def test_a_list_of_the_wrong_length_is_an_error_naming_the_argument(model, rows):
    tokens, mask = padded(rows, "right")
    with pytest.raises(wb.InputError, match="answer_token has 2 entries but there are 3 prompts"):
        ablation_effect(model, tokens, TARGETS, logit_diff(model, ANSWERS[:2], WRONGS, 3), attention_mask=mask)
    with pytest.raises(wb.InputError, match="wrong_token has 4 entries"):
        logit_lens_metric(model, tokens, logit_diff(model, ANSWERS, WRONGS + [5], 3), attention_mask=mask)
    with pytest.raises(wb.InputError, match="target_token has 2 entries"):
        direct_logit_attribution(model, tokens, ANSWERS[:2], attention_mask=mask)
    with pytest.raises(wb.InputError, match="baseline_token has 4 entries"):
        direct_logit_attribution(model, tokens, ANSWERS, WRONGS + [5], attention_mask=mask)
    with pytest.raises(wb.InputError, match="outside the vocabulary"):
        direct_logit_attribution(model, tokens, [5, 6, VOCAB], attention_mask=mask)
    with pytest.raises(wb.InputError, match=r"position -1 is a pad in prompt\(s\) \[0, 1\]"):
        direct_logit_attribution(model, tokens, 5, position=-1, attention_mask=mask)  # right padding


def test_a_mask_of_the_wrong_shape_is_the_models_error(model, rows):
    tokens, mask = padded(rows, "left")
    wrong = mask[:, 1:]
    calls = [lambda: ablation_effect(model, tokens, TARGETS, attention_mask=wrong),
             lambda: run_ablated(model, tokens, TARGETS, "mean", attention_mask=wrong),
             lambda: ablation_effect(model, tokens, TARGETS, "loss", "mean", tokens, attention_mask=mask,
                                     reference_mask=wrong),
             lambda: per_token_loss_change(model, tokens, TARGETS, attention_mask=wrong),
             lambda: logit_lens_metric(model, tokens, "loss", attention_mask=wrong),
             lambda: logit_lens(model, tokens, attention_mask=wrong),
             lambda: direct_logit_attribution(model, tokens, 5, attention_mask=wrong)]
    for call in calls:
        with pytest.raises(wb.InputError, match=r"attention_mask has shape \(3, 10\) but the tokens have \(3, 11\)"):
            call()


def test_bad_references_are_named(model, rows):
    tokens, mask = padded(rows, "right")
    means = mean_reference(model, tokens, TARGETS[:1], reference_mask=mask)
    with pytest.raises(wb.InputError, match="reference_means has no mean for"):
        ablation_effect(model, tokens, TARGETS[:2], method="mean", attention_mask=mask, reference_means=means)
    with pytest.raises(wb.InputError, match="serves mean ablation only"):
        ablation_effect(model, tokens, TARGETS[:1], method="resample", attention_mask=mask, reference_means=means)
    with pytest.raises(wb.InputError, match="give one of them"):
        ablation_effect(model, tokens, TARGETS[:1], method="mean", reference_tokens=tokens, reference_means=means)
    short = mean_reference(model, tokens[:1, :5], TARGETS[:1])  # 5 positions; the prompts have up to 11
    with pytest.raises(wb.InputError, match="the reference has 5 positions, fewer than the input's 11"):
        ablation_effect(model, tokens, TARGETS[:1], method="mean", attention_mask=mask, reference_means=short)
    with pytest.raises(wb.InputError, match="per_prompt=True needs a metric with one value per prompt"):
        ablation_effect(model, tokens, TARGETS[:1], lambda logits, toks: logits.mean(), attention_mask=mask,
                        per_prompt=True)
