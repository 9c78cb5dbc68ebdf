"""Measuring a zoo model: the circuit facts its card reports (induction and previous-token heads, what
ablating them does, expert load). Training lives in ``workbench.train``; this module measures, so the
cards report exactly what the experiments compute.

Legend: L n_layers, H n_heads, E num_experts.

``python -m experiments.zoo --recipe NAME --out DIR`` (``workbench train`` runs it) trains a recipe and
writes its checkpoint and card; that pipeline is ``experiments.cli.zoo`` (``run_recipe``,
``regenerate_card``), the card's text ``experiments.plots.zoo.model_card``.
"""

from __future__ import annotations

from typing import Any

import torch

from experiments.ablation import AblationTarget, ablation_hooks
from experiments.attention import prev_token_share
from experiments.induction import copy_losses, induction_scores
from experiments.router import expert_load, top_expert_predictability
from workbench.model import Decoder
from workbench.train import fixed_windows

PROBE_WINDOWS, PROBE_SEQ_LEN = 32, 128  # held-out windows for previous-token and expert-load measurements
INDUCTION = dict(seq_len=50, batch=16, seed=0)  # the cards' repeated random tokens (BOS first)
MEASURED = ("induction_scores", "previous_token_scores", "induction_head", "previous_token_head",
            "induction_score_with_previous_token_head_ablated", "layer1_induction_heads", "repeated_copy_loss",
            "repeated_copy_loss_induction_heads_ablated", "expert_load", "top_expert_predictability")


def measure(model: Decoder, held_out_stream: torch.Tensor) -> dict[str, Any]:
    """The circuit facts a card reports: induction / previous-token heads, ablations, expert load.

    Example (seconds: several passes over 32 windows of 128 tokens):
        >>> held_out_stream = model.to_tokens("def f(x): return x + 1; " * 400)[0]
        >>> facts = measure(model, held_out_stream)                     # doctest: +SKIP
        >>> facts["previous_token_head"], facts["induction_head"]      # doctest: +SKIP
        ([0, 0], [1, 1])
    """
    probe = fixed_windows(held_out_stream, PROBE_SEQ_LEN, PROBE_WINDOWS, bos=0)
    induction_LH = induction_scores(model, **INDUCTION)
    previous_LH = prev_token_share(model, probe)
    facts: dict[str, Any] = {"induction_scores": induction_LH.tolist(), "previous_token_scores": previous_LH.tolist()}
    if model.cfg.n_layers >= 2:
        induction_head = int(induction_LH[1].argmax())
        previous_head = int(previous_LH[0].argmax())
        induction_heads = [h for h in range(model.cfg.n_heads) if induction_LH[1, h] > 0.2] or [induction_head]
        with model.hooks(fwd_hooks=ablation_hooks(model, [AblationTarget("head", 0, previous_head)])):
            without_previous = induction_scores(model, **INDUCTION)[1, induction_head].item()
        with model.hooks(fwd_hooks=ablation_hooks(model, [AblationTarget("head", 1, h) for h in induction_heads])):
            copies_without_induction = copy_losses(model, **INDUCTION)
        facts.update({
            "induction_head": [1, induction_head],
            "previous_token_head": [0, previous_head],
            "induction_score_with_previous_token_head_ablated": without_previous,
            "layer1_induction_heads": induction_heads,
            "repeated_copy_loss": copy_losses(model, **INDUCTION),
            "repeated_copy_loss_induction_heads_ablated": copies_without_induction,
        })
    if model.cfg.is_moe:
        load = expert_load(model, probe).pivot(index="layer", columns="expert", values="token_fraction")
        facts["expert_load"] = load.values.tolist()
        facts["top_expert_predictability"] = top_expert_predictability(model, probe)
    return facts


if __name__ == "__main__":  # the command line lives in experiments.cli.zoo (training needs gradients)
    from experiments._cli import run_command

    run_command("zoo", gradients=True)
