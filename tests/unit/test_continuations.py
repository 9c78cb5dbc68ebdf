"""Continuations with and without an ablation (experiments.continuations), against hand-written loops.

Every expected continuation is a loop written here: the argmax (or a seeded sample) of ``model(tokens)``
over the whole sequence at each step, with the ablation done by hand (a head's ``hook_z`` slice
zeroed or replaced by a hand-computed reference mean, an expert's output weights zeroed in a copy of
the model), never read from the function under test.
"""

from __future__ import annotations

import copy

import pytest
import torch

import workbench as wb
from experiments import continuations
from experiments.ablation import AblationTarget
from experiments.continuations import continue_with_ablation, first_divergence
from experiments.plots.continuations import highlighted_html
from tests.unit.helpers import make_model

PROMPT = torch.tensor([[3, 17, 5, 42, 8, 11]])


@pytest.fixture(scope="module")
def model():
    return make_model("gqa_rotary_rms_swiglu", seed=1)


def attached_hooks(model) -> int:
    return sum(len(point.fwd_hooks) + len(point.bwd_hooks) for point in model.hook_dict.values())


@torch.no_grad()
def hand_loop(model, tokens, steps: int, fwd_hooks=(), sample=None):
    """Greedy (or ``sample(logits_V)``) continuation by rerunning the whole sequence at every step."""
    ids, logprobs = [], []
    for _ in range(steps):
        logits_V = model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks))[0, -1].float()
        next_id = int(logits_V.argmax()) if sample is None else sample(logits_V)
        ids.append(next_id)
        logprobs.append(float(logits_V.log_softmax(-1)[next_id]))
        tokens = torch.cat([tokens, torch.tensor([[next_id]])], 1)
    return ids, logprobs


def zero_head(head: int):
    def hook(z_BPHK, hook):
        z_BPHK = z_BPHK.clone()
        z_BPHK[:, :, head] = 0.0
        return z_BPHK
    return hook


def test_greedy_clean_continuation_is_the_argmax_loop(model):
    result = continue_with_ablation(model, PROMPT, [("head", 0, 1)], max_new_tokens=8)
    ids, logprobs = hand_loop(model, PROMPT, 8)
    assert list(result.clean_tokens) == ids
    assert result.clean_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert result.prompt_tokens == tuple(PROMPT[0].tolist())


def test_zero_ablated_head_matches_a_hand_zeroed_hook_z(model):
    result = continue_with_ablation(model, PROMPT, [AblationTarget("head", 1, 2)], "zero", max_new_tokens=8)
    ids, logprobs = hand_loop(model, PROMPT, 8, [("blocks.1.attn.hook_z", zero_head(2))])
    assert list(result.ablated_tokens) == ids
    assert result.ablated_logprobs == pytest.approx(logprobs, abs=1e-4)
    clean_first = hand_loop(model, PROMPT, 1)[1][0]
    assert abs(result.ablated_logprobs[0] - clean_first) > 1e-4 or result.ablated_tokens[0] != result.clean_tokens[0]
    assert result.first_divergence == first_divergence(result.clean_tokens, ids)
    assert result.targets == ("head L1H2",)


def test_mean_ablation_writes_the_reference_mean_at_each_position(model):
    steps, layer, head = 5, 0, 3
    torch.manual_seed(0)
    reference = torch.randint(0, model.cfg.d_vocab, (3, PROMPT.shape[1] + steps - 1))
    with torch.no_grad():
        _, cache = model.run_with_cache(reference, names_filter=f"blocks.{layer}.attn.hook_z")
    mean_SK = cache[f"blocks.{layer}.attn.hook_z"][:, :, head].mean(0)  # by hand: over the 3 reference rows

    def mean_head(z_BPHK, hook):
        z_BPHK = z_BPHK.clone()
        z_BPHK[0, :, head] = mean_SK[:z_BPHK.shape[1]]
        return z_BPHK

    result = continue_with_ablation(model, PROMPT, [("head", layer, head)], "mean", max_new_tokens=steps,
                                    reference_tokens=reference)
    ids, logprobs = hand_loop(model, PROMPT, steps, [(f"blocks.{layer}.attn.hook_z", mean_head)])
    assert list(result.ablated_tokens) == ids
    assert result.ablated_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert result.ablated_logprobs != pytest.approx(result.clean_logprobs, abs=1e-4)  # the ablation did something


def test_zero_ablated_expert_matches_a_copy_without_its_output_weights():
    moe = make_model("moe_gqa", seed=2)
    without = copy.deepcopy(moe)
    with torch.no_grad():
        without.blocks[1].mlp.W_out[3].zero_()  # expert 3's output is then zero wherever it is chosen
    result = continue_with_ablation(moe, PROMPT, [("expert", 1, 3)], max_new_tokens=6)
    ids, logprobs = hand_loop(without, PROMPT, 6)
    assert list(result.ablated_tokens) == ids
    assert result.ablated_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert result.ablated_logprobs != pytest.approx(result.clean_logprobs, abs=1e-4)  # expert 3 ran somewhere


def test_the_same_seed_gives_the_same_sample(model):
    settings = dict(max_new_tokens=10, temperature=1.3, top_k=20)
    first = continue_with_ablation(model, PROMPT, [("head", 0, 0)], seed=7, **settings)
    again = continue_with_ablation(model, PROMPT, [("head", 0, 0)], seed=7, **settings)
    other = continue_with_ablation(model, PROMPT, [("head", 0, 0)], seed=8, **settings)
    assert first.clean_tokens == again.clean_tokens and first.ablated_tokens == again.ablated_tokens
    assert other.clean_tokens != first.clean_tokens  # 10 draws over 20 tokens: a repeat is vanishingly unlikely


def test_an_ablation_that_changes_nothing_gives_the_same_sample_in_both_runs(model):
    """Resampling a head from the clean continuation itself writes the activation it already has: with the
    same seed the ablated run must draw exactly the clean run's tokens."""
    settings = dict(max_new_tokens=8, temperature=1.0, seed=3)
    clean = continue_with_ablation(model, PROMPT, [("head", 1, 0)], **settings)
    itself = torch.cat([PROMPT, torch.tensor([clean.clean_tokens])], 1)
    result = continue_with_ablation(model, PROMPT, [("head", 1, 0)], "resample", reference_tokens=itself, **settings)
    assert result.ablated_tokens == result.clean_tokens == clean.clean_tokens
    assert result.ablated_logprobs == pytest.approx(result.clean_logprobs, abs=1e-5)
    assert result.first_divergence is None


def test_top_k_of_one_samples_the_argmax(model):
    sampled = continue_with_ablation(model, PROMPT, [("head", 0, 0)], max_new_tokens=6, temperature=0.7, top_k=1)
    assert list(sampled.clean_tokens) == hand_loop(model, PROMPT, 6)[0]


def test_no_hook_is_left_after_success_or_error(model, monkeypatch):
    continue_with_ablation(model, PROMPT, [("head", 0, 1), ("attn_layer", 1, None)], max_new_tokens=3)
    assert attached_hooks(model) == 0
    with pytest.raises(wb.InputError, match="exceeds the model's context"):  # raised inside the hooks' context
        continue_with_ablation(model, PROMPT, [("head", 0, 1)], max_new_tokens=model.cfg.n_ctx)
    assert attached_hooks(model) == 0

    def failing(model_, *args, **kwargs):  # the clean run (no hooks) goes through; the ablated one fails
        if attached_hooks(model_):
            raise RuntimeError("generation failed half way")
        return real(model_, *args, **kwargs)

    real = continuations.generate_tokens
    monkeypatch.setattr(continuations, "generate_tokens", failing)
    with pytest.raises(RuntimeError, match="half way"):
        continue_with_ablation(model, PROMPT, [("head", 0, 1)], max_new_tokens=3)
    assert attached_hooks(model) == 0


def test_clear_errors(model):
    with pytest.raises(wb.InputError, match="needs reference_tokens"):
        continue_with_ablation(model, PROMPT, [("head", 0, 1)], "mean")
    short = torch.randint(0, model.cfg.d_vocab, (2, PROMPT.shape[1] + 2))
    with pytest.raises(wb.InputError, match=f"needs {PROMPT.shape[1] + 4} tokens"):
        continue_with_ablation(model, PROMPT, [("head", 0, 1)], "mean", max_new_tokens=5, reference_tokens=short)
    with pytest.raises(wb.InputError, match="no ablation targets"):
        continue_with_ablation(model, PROMPT, [])
    with pytest.raises(wb.InputError, match="one prompt"):
        continue_with_ablation(model, PROMPT.repeat(2, 1), [("head", 0, 1)])
    with pytest.raises(wb.InputError, match="layer must be in"):
        continue_with_ablation(model, PROMPT, [("head", 9, 1)])


def test_table_has_one_row_per_step_and_marks_the_shared_tokens():
    result = continuations.Continuations(
        prompt_tokens=(1,), clean_tokens=(5, 6, 7), ablated_tokens=(5, 9), clean_str_tokens=("a", "b", "c"),
        ablated_str_tokens=("a", "x"), clean_logprobs=(-0.1, -0.2, -0.3), ablated_logprobs=(-0.1, -2.0),
        first_divergence=1, method="zero", targets=("head L0H1",))
    table = result.to_frame()
    assert table["step"].tolist() == [0, 1, 2]
    assert table["same"].tolist() == [True, False, False]
    assert table["ablated_token"].tolist()[:2] == ["a", "x"] and table["ablated_token"].isna().tolist() == [False, False, True]
    assert table["ablated_token_id"].tolist()[:2] == [5, 9] and table["ablated_token_id"].isna().tolist()[2]
    assert result.clean_text == "abc" and result.ablated_text == "ax"


def test_first_divergence_by_hand():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 4, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], [5]) == 0


def test_highlighted_html_escapes_and_marks_from_the_divergence():
    text = highlighted_html(["<a>", " &", "\n"], 1, color="red")
    assert text == ('<span title="step 0">&lt;a&gt;</span><span title="step 1" style="background:red"> &amp;</span>'
                    '<span title="step 2" style="background:red">\n</span>')
    assert "background" not in highlighted_html(["a", "b"], None)
