"""Zero, mean and resample ablation of heads, attention/MLP layers, neurons and experts.

Legend: B batch, P position, H heads, K d_head, D d_model, M d_mlp, k experts per token.

Where each kind is ablated (TransformerLens hook names):
  head        blocks.{l}.attn.hook_z [B, P, H, K], head ``index``
  attn_layer  blocks.{l}.hook_attn_out [B, P, D] (the attention output bias included)
  mlp_layer   blocks.{l}.hook_mlp_out [B, P, D]
  neuron      blocks.{l}.mlp.hook_post [B, P, M], neuron ``index`` (dense MLPs)
  expert      blocks.{l}.mlp.hook_expert_weights: expert ``index``'s router weight set to zero
              wherever it was chosen (the other chosen experts keep theirs; zero ablation only)
Methods: "zero" writes zeros; "mean" writes the reference batch's mean at each position;
"resample" writes the activation of another prompt (reference row b % n_ref, or, when the
reference is the input batch itself, row (b + 1) % B).

``python -m experiments.ablation --model NAME --out DIR [--prompt TEXT]`` runs a zero-ablation
``head_sweep`` and writes the per-head loss change.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from experiments._ablation_targets import (KINDS, METHODS, AblationTarget, Hook, Kind, Method, _check_method,
                                           _reference_values, _replace, ablation_hooks)
from experiments._batched import DEFAULT_TOKENS_PER_PASS, Edit, Metric, clean_run, score_edits
from experiments._progress import ProgressArg
from experiments._tokens import TokensLike, as_batch, str_tokens

__all__ = ["AblationTarget", "ablation_hooks", "run_ablated", "head_sweep", "per_token_loss_change",
           "top_predictions_change", "KINDS", "METHODS"]

def _hooks_for_input(model, tokens_BP: Tensor, targets, method: str, reference_tokens) -> list[Hook]:
    """Hooks where a missing reference means the input batch itself (resample: another row of it)."""
    if reference_tokens is None and method != "zero":
        return ablation_hooks(model, targets, method, tokens_BP, resample_shift=1 if method == "resample" else 0)
    return ablation_hooks(model, targets, method, reference_tokens)


def run_ablated(model, tokens: TokensLike, targets: Sequence[AblationTarget], method: Method = "zero",
                reference_tokens: Optional[TokensLike] = None, return_type: Optional[str] = "logits"):
    """Runs the model with ``targets`` ablated; returns what ``model(..., return_type=)`` returns.

    Without ``reference_tokens``, "mean" uses the input batch's own mean and "resample" gives
    each row the activations of the next row.

    Example:
        >>> run_ablated(model, tokens, [AblationTarget("attn_layer", 0)], return_type="loss")   # doctest: +SKIP
    """
    tokens_BP = as_batch(model, tokens)
    hooks = _hooks_for_input(model, tokens_BP, targets, method, reference_tokens)
    return model.run_with_hooks(tokens_BP, return_type=return_type, fwd_hooks=hooks)


def head_sweep(model, tokens: TokensLike, metric: Metric = "loss", method: Method = "zero",
               reference_tokens: Optional[TokensLike] = None, progress: ProgressArg = True,
               tokens_per_pass: int = DEFAULT_TOKENS_PER_PASS) -> pd.DataFrame:
    """Ablates every (layer, head) in turn and scores it: DataFrame[layer, head, metric, delta].

    ``metric`` is "loss" (mean next-token loss) or a callable ``(logits, tokens) -> scalar``;
    ``delta`` is ablated minus clean. The clean run's residual stream is reused up to each
    head's layer and many heads are ablated per batched pass (see ``experiments._batched``),
    so this is several times faster than one ``run_with_hooks`` per head, with the same result.

    Example:
        >>> df = head_sweep(model, model.to_tokens("The cat sat on the mat."), progress=False)   # doctest: +SKIP
        >>> df.sort_values("delta", ascending=False).head()                                      # doctest: +SKIP
    """
    _check_method(method)
    tokens_BP = as_batch(model, tokens)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    z_names = [f"blocks.{l}.attn.hook_z" for l in range(L)]
    clean_value, resid_pre, _ = clean_run(model, tokens_BP, metric)
    values = {}
    if method != "zero":
        reference = tokens_BP if reference_tokens is None else as_batch(model, reference_tokens)
        shift = 1 if (method == "resample" and reference_tokens is None) else 0
        with torch.no_grad():
            values = _reference_values(model, set(z_names), method, reference, shift)
    B, P = tokens_BP.shape
    edits = []
    for layer in range(L):
        value = values[z_names[layer]](B, P) if values else None
        for head in range(H):
            target = AblationTarget("head", layer, head)
            edits.append(Edit(layer, z_names[layer], lambda z, t=target, v=value: _replace(z, t, v)))
    scores = score_edits(model, resid_pre, tokens_BP, edits, metric, progress, tokens_per_pass, desc="head sweep")
    return pd.DataFrame({"layer": np.repeat(np.arange(L), H), "head": np.tile(np.arange(H), L),
                         "metric": scores.numpy(), "delta": scores.numpy() - clean_value})


@torch.no_grad()
def per_token_loss_change(model, tokens: TokensLike, targets: Sequence[AblationTarget], method: Method = "zero",
                          reference_tokens: Optional[TokensLike] = None) -> pd.DataFrame:
    """Loss of predicting each token, clean and ablated (batch item 0).

    Row ``position`` p is the loss of predicting token p from positions < p (p >= 1).

    Example:
        >>> per_token_loss_change(model, tokens, [AblationTarget("head", 1, 4)]).nlargest(5, "delta")   # doctest: +SKIP
    """
    tokens_BP = as_batch(model, tokens)
    clean = model(tokens_BP, return_type="loss", loss_per_token=True)[0]
    hooks = _hooks_for_input(model, tokens_BP, targets, method, reference_tokens)
    ablated = model.run_with_hooks(tokens_BP, return_type="loss", loss_per_token=True, fwd_hooks=hooks)[0]
    return pd.DataFrame({"position": np.arange(1, tokens_BP.shape[1]), "token": str_tokens(model, tokens_BP[0, 1:]),
                         "clean_loss": clean.float().cpu().numpy(), "ablated_loss": ablated.float().cpu().numpy(),
                         "delta": (ablated - clean).float().cpu().numpy()})


@torch.no_grad()
def top_predictions_change(model, tokens: TokensLike, targets: Sequence[AblationTarget], method: Method = "zero",
                           k: int = 5, reference_tokens: Optional[TokensLike] = None,
                           position: int = -1) -> pd.DataFrame:
    """The top-k next-token predictions at ``position`` (batch item 0), clean beside ablated.

    Columns: rank, clean_token, clean_token_id, clean_prob, ablated_token, ablated_token_id,
    ablated_prob, and ablated_prob_of_clean (how the clean prediction fares after ablation).

    Example:
        >>> top_predictions_change(model, "The Eiffel Tower is in", [AblationTarget("mlp_layer", 5)], "zero")   # doctest: +SKIP
    """
    tokens_BP = as_batch(model, tokens)
    clean = model(tokens_BP)[0, position].float().softmax(-1)
    ablated = run_ablated(model, tokens_BP, targets, method, reference_tokens)[0, position].float().softmax(-1)
    clean_p, clean_ids = clean.topk(k)
    ablated_p, ablated_ids = ablated.topk(k)
    return pd.DataFrame({
        "rank": np.arange(1, k + 1),
        "clean_token": str_tokens(model, clean_ids.cpu()), "clean_token_id": clean_ids.cpu().numpy(),
        "clean_prob": clean_p.cpu().numpy(),
        "ablated_token": str_tokens(model, ablated_ids.cpu()), "ablated_token_id": ablated_ids.cpu().numpy(),
        "ablated_prob": ablated_p.cpu().numpy(),
        "ablated_prob_of_clean": ablated[clean_ids].cpu().numpy(),
    })


def main(argv: Optional[Sequence[str]] = None) -> None:
    from experiments import _cli
    from experiments.figures import scores_heatmap

    parser = _cli.make_parser("Ablate every head in turn and record the change in loss.")
    parser.add_argument("--prompt", default=None, help="text to run (default: a fixed example)")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    tokens = _cli.prompt_tokens(model, args.prompt)
    # One prompt: mean and resample would replace it by itself, so the command zero-ablates.
    table = head_sweep(model, tokens, "loss", "zero", progress=not args.no_progress)
    deltas = torch.tensor(table.delta.values).view(model.cfg.n_layers, model.cfg.n_heads)
    fig = scores_heatmap(deltas, "Loss change when zero-ablating each head", colorscale="RdBu_r",
                         zmid=0.0, value_name="delta loss")
    _cli.write_outputs(args.out, "head_sweep", table, fig,
                       {"experiment": "head_sweep", "model": args.model, "method": "zero",
                        "n_tokens": int(tokens.numel())})


if __name__ == "__main__":
    from experiments._cli import run_main

    run_main(main)
