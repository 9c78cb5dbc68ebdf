"""Induction heads on repeated random tokens: per-head scores and the per-position loss.

Legend: B batch, L n_layers, H n_heads, C copy length, P position, S key position.

A sequence has P = 1 + 2C positions (C = ``seq_len``).

A sequence is [prefix] + r + r with r random tokens: the prefix is BOS when the tokenizer
has one (else token 0), and r has no repeated token within a copy, so each token of the second
copy has exactly one earlier occurrence. An induction head attends from position i of the
second copy (i in S+1 .. 2S) to the token after the earlier occurrence, i - S + 1.

``python -m experiments.induction --model NAME --out DIR [--seq-len 50 --batch 10 --seed 0]``
writes the scores (CSV/JSON, top heads first) and their heatmap (HTML), plus the loss table.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.datasets import prefix_token, repeated_random_tokens  # the one implementation, re-exported here
from experiments.figures import scores_heatmap

__all__ = ["repeated_random_tokens", "prefix_token", "induction_scores", "induction_loss", "copy_losses",
           "scores_heatmap", "top_heads"]


def fitting_seq_len(model, wanted: int) -> int:
    """The largest seq_len <= ``wanted`` that ``repeated_random_tokens`` can build for this model.

    Example:
        >>> fitting_seq_len(model_with_20_tokens, 25)   # doctest: +SKIP
        19
    """
    return max(1, min(wanted, model.cfg.d_vocab - 1, (model.cfg.n_ctx - 1) // 2))


def induction_stripe(pattern_BHPS: Float[Tensor, "batch n_heads pos pos"], seq_len: int) -> Float[Tensor, "batch n_heads seq_len"]:
    """Attention from each second-copy position i to i - seq_len + 1.

    Example:
        >>> induction_stripe(torch.eye(5)[None, None], 2).shape
        torch.Size([1, 1, 2])
    """
    # Queries S+1 .. 2S sit on the diagonal with offset k - q = 1 - S, whose entries start at q = S - 1.
    return pattern_BHPS.diagonal(offset=1 - seq_len, dim1=-2, dim2=-1)[..., 2:]


@torch.no_grad()
def induction_scores(model, seq_len: int = 50, batch: int = 10, seed: int = 0,
                     progress: ProgressArg = False) -> Float[Tensor, "n_layers n_heads"]:
    """Mean attention from each token of the repeat to the token after its earlier occurrence.

    One forward pass over ``repeated_random_tokens(model, seq_len, batch, seed)``; each layer's
    pattern is reduced as it is computed. ``progress`` reports layers done.

    Example:
        >>> scores_LH = induction_scores(model, seq_len=50, batch=10)   # doctest: +SKIP
        >>> top_heads(scores_LH, 5)                                       # doctest: +SKIP
    """
    tokens = repeated_random_tokens(model, seq_len, batch, seed)
    L = model.cfg.n_layers
    scores = torch.zeros(L, model.cfg.n_heads)
    with Progress(progress, total=L, desc="induction scores") as bar:
        def score_layer(pattern_BHPS: Tensor, hook) -> None:
            scores[hook.layer()] = induction_stripe(pattern_BHPS.float(), seq_len).mean((0, 2)).cpu()
            bar.advance()

        model.run_with_hooks(tokens, return_type=None,
                             fwd_hooks=[(f"blocks.{l}.attn.hook_pattern", score_layer) for l in range(L)])
    return scores


@torch.no_grad()
def induction_loss(model, seq_len: int = 50, batch: int = 10, seed: int = 0) -> pd.DataFrame:
    """Next-token loss at each position of the two copies, averaged over the batch.

    Row (position=j, copy=c) is the loss of predicting token j of copy c (j in 0..seq_len-1);
    an induction-capable model's loss falls on the second copy.

    Example:
        >>> df = induction_loss(model)                                   # doctest: +SKIP
        >>> df.groupby("copy").loss.mean()                               # doctest: +SKIP
    """
    mean_P = _repeat_losses(model, seq_len, batch, seed).float().mean(0).cpu().numpy()
    return pd.DataFrame({
        "position": np.tile(np.arange(seq_len), 2),
        "copy": ["first"] * seq_len + ["second"] * seq_len,
        "loss": mean_P,
    })


def _repeat_losses(model, seq_len: int, batch: int, seed: int) -> Float[Tensor, "batch two_seq_len"]:
    """Per-token loss on ``repeated_random_tokens``: column j predicts token j + 1 (tokens 1..2C)."""
    tokens = repeated_random_tokens(model, seq_len, batch, seed)
    return model(tokens, return_type="loss", loss_per_token=True)


@torch.no_grad()
def copy_losses(model, seq_len: int = 50, batch: int = 10, seed: int = 0) -> dict[str, float]:
    """Mean loss on predicting tokens 2..C of the first copy and tokens 2..C of the second.

    The first token of each copy is left out: it cannot be predicted in the first copy, and it is
    the one token of the second copy that needs no induction. A model with induction heads has a
    far lower second-copy loss.

    Example:
        >>> copy_losses(model)   # doctest: +SKIP
        {'first_copy': 7.9, 'second_copy': 1.2}
    """
    loss_BP = _repeat_losses(model, seq_len, batch, seed)
    # loss_BP[:, j] predicts token j + 1; the first copy is tokens 1..C, the second C+1..2C.
    return {"first_copy": loss_BP[:, 1:seq_len].mean().item(), "second_copy": loss_BP[:, seq_len + 1:].mean().item()}


def top_heads(scores_LH: Float[Tensor, "n_layers n_heads"], k: int = 10) -> pd.DataFrame:
    """The k highest-scoring heads as a table [layer, head, score], best first.

    Example:
        >>> top_heads(torch.tensor([[0.25, 0.75], [0.5, 0.125]]), 2).values.tolist()
        [[0.0, 1.0, 0.75], [1.0, 0.0, 0.5]]
    """
    H = scores_LH.shape[1]
    values, flat = scores_LH.flatten().topk(min(k, scores_LH.numel()))
    return pd.DataFrame({"layer": (flat // H).numpy(), "head": (flat % H).numpy(), "score": values.float().numpy()})


def induction_loss_figure(loss_df: pd.DataFrame):
    """Per-position loss of the first and second copy as two lines.

    Example:
        >>> induction_loss_figure(induction_loss(model))   # doctest: +SKIP
    """
    import plotly.express as px

    fig = px.line(loss_df, x="position", y="loss", color="copy", title="Loss on repeated random tokens")
    return fig


@torch.no_grad()
def induction_per_prompt(model, tokens: Tensor, seq_len: int) -> pd.DataFrame:
    """Each prompt's induction score per head on repeated random tokens [B, 1 + 2*seq_len]: DataFrame[prompt, layer, head, score].

    The mean over prompts is ``induction_scores`` (the same stripe, ``experiments.induction.induction_stripe``).

    Example:
        >>> rows = induction_per_prompt(model, repeated_random_tokens(model, 50, 10), 50)   # doctest: +SKIP
    """
    L, H, B = model.cfg.n_layers, model.cfg.n_heads, tokens.shape[0]
    scores_LBH = torch.zeros(L, B, H)

    def score_layer(pattern_BHPS: Tensor, hook) -> None:
        scores_LBH[hook.layer()] = induction_stripe(pattern_BHPS.float(), seq_len).mean(2).cpu()

    model.run_with_hooks(tokens, return_type=None,
                         fwd_hooks=[(f"blocks.{l}.attn.hook_pattern", score_layer) for l in range(L)])
    return pd.DataFrame({"prompt": np.repeat(np.arange(B), L * H), "layer": np.tile(np.repeat(np.arange(L), H), B),
                         "head": np.tile(np.arange(H), B * L), "score": scores_LBH.permute(1, 0, 2).reshape(-1).numpy()})


@torch.no_grad()
def induction_loss_per_prompt(model, tokens: Tensor, seq_len: int) -> pd.DataFrame:
    """Each prompt's next-token loss on both copies: DataFrame[prompt, position, copy, loss] (mean over prompts: ``induction_loss``).

    Example:
        >>> rows = induction_loss_per_prompt(model, repeated_random_tokens(model, 50, 10), 50)   # doctest: +SKIP
    """
    loss_BP = model(tokens, return_type="loss", loss_per_token=True).float().cpu()
    B = tokens.shape[0]
    return pd.DataFrame({"prompt": np.repeat(np.arange(B), 2 * seq_len), "position": np.tile(np.arange(seq_len), 2 * B),
                         "copy": np.tile(["first"] * seq_len + ["second"] * seq_len, B),
                         "loss": loss_BP.reshape(-1).numpy()})


def main(argv: Optional[Sequence[str]] = None) -> None:
    from experiments import _cli

    parser = _cli.make_parser("Induction scores on repeated random tokens, and the loss on each copy.",
                              "induction", per_prompt=True)
    parser.add_argument("--seq-len", type=int, default=50)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = _cli.load(args)
    if _cli.sharded(args):  # per sequence, then the means over sequences
        from experiments import distributed

        tokens = repeated_random_tokens(model, args.seq_len, args.batch, args.seed)
        with _cli.worker_pool(args) as pool:
            rows = pool.run(induction_per_prompt, tokens, progress=not args.no_progress, seq_len=args.seq_len)
            loss_rows = pool.run(induction_loss_per_prompt, tokens, progress=False, seq_len=args.seq_len)
        means = distributed.mean_over_prompts(rows, ["layer", "head"])
        scores = torch.tensor(means["score"].to_numpy()).view(model.cfg.n_layers, model.cfg.n_heads)
        loss = distributed.mean_over_prompts(loss_rows, ["position", "copy"])
    else:
        scores = induction_scores(model, args.seq_len, args.batch, args.seed, progress=not args.no_progress)
        loss = induction_loss(model, args.seq_len, args.batch, args.seed)
    table = top_heads(scores, scores.numel())
    params = {"seq_len": args.seq_len, "batch": args.batch, "seed": args.seed}
    _cli.write_outputs(args.out, "induction", table, scores_heatmap(scores, "Induction score"),
                       {"experiment": "induction", "model": args.model, **params,
                        "mean_loss_by_copy": loss.groupby("copy").loss.mean().to_dict()})
    _cli.write_outputs(args.out, "induction_loss", loss, induction_loss_figure(loss),
                       {"experiment": "induction_loss", "model": args.model, **params})


if __name__ == "__main__":
    from experiments._cli import run_main

    run_main(main)
