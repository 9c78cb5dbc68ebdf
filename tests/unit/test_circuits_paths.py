"""Path patching, checked by hand.

Into the logits: the corrupted final residual stream plus the sender's clean - corrupted output, unembedded.
Into a head's value: the receiver's pattern is the corrupted run's (only its values move), so its output moves by
pattern @ ((ln1(x + d) - ln1(x)) W_V) W_O with x the corrupted input and d the sender's clean - corrupted output;
the final residual stream moves by that, the rest of the corrupted run as it was (no later layer).
"""

from __future__ import annotations

import torch

from experiments.circuits import path_patching
from experiments.metrics import LogitDiff, PromptBatch
from tests.unit.helpers import make_model

TOKENS = torch.randint(0, 61, (3, 7), generator=torch.Generator().manual_seed(3))
CORRUPT = TOKENS.clone()
CORRUPT[:, [1, 4]] = torch.randint(0, 61, (3, 2), generator=torch.Generator().manual_seed(4))
METRIC = LogitDiff(torch.tensor([5, 9, 11]), torch.tensor([7, 3, 20]))


def test_path_patching_into_the_logits_and_into_a_heads_value_by_hand():
    model = make_model("attn_only_tied", positional="learned")
    names = ["blocks.0.attn.hook_result", "blocks.1.hook_resid_pre", "blocks.1.hook_resid_post",
             "blocks.1.attn.hook_pattern"]
    _, clean = model.run_with_cache(TOKENS, names_filter=names)
    _, corrupt = model.run_with_cache(CORRUPT, names_filter=names)
    sender, receiver = 2, 1
    d = (clean[names[0]] - corrupt[names[0]])[:, :, sender]
    by_hand = lambda resid: float(METRIC.values(model.logits_from_resid(resid), PromptBatch(CORRUPT)).mean().detach())  # noqa: E731
    table = path_patching(model, TOKENS, CORRUPT, METRIC, [(0, sender)], ["logits"])
    assert abs(table["metric"][0] - by_hand(corrupt[names[2]] + d)) < 1e-5

    attn, ln1 = model.blocks[1].attn, model.blocks[1].ln1
    x = corrupt[names[1]]
    values_moved = (ln1(x + d) - ln1(x)) @ attn.W_V[receiver]  # [B, P, d_head]; the bias cancels
    z_moved = corrupt[names[3]][:, receiver] @ values_moved  # [B, P, d_head]
    table = path_patching(model, TOKENS, CORRUPT, METRIC, [(0, sender)], [(1, receiver)], "v")
    assert abs(table["metric"][0] - by_hand(corrupt[names[2]] + z_moved @ attn.W_O[receiver])) < 1e-5
