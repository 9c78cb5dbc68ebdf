"""Induction heads on repeated random tokens: per-head scores and the per-position loss.

Legend: B batch, L n_layers, H n_heads, C copy length, P position, S key position.

A sequence has P = 1 + 2C positions (C = ``seq_len``).

A sequence is [prefix] + r + r with r random tokens: the prefix is BOS when the tokenizer
has one (else token 0), and r has no repeated token within a copy, so each token of the second
copy has exactly one earlier occurrence. An induction head attends from position i of the
second copy (i in S+1 .. 2S) to the token after the earlier occurrence, i - S + 1.

Figures: ``experiments.plots.induction``. ``python -m experiments.induction --model NAME --out DIR
[--seq-len 50 --batch 10 --seed 0]`` (``experiments.cli.induction``) writes the scores (CSV/JSON,
top heads first) and their heatmap (HTML), plus the loss table.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.datasets import prefix_token, repeated_random_tokens  # the one implementation, re-exported here

__all__ = ["repeated_random_tokens", "prefix_token", "induction_scores", "induction_loss", "copy_losses", "top_heads"]


def fitting_seq_len(model, wanted: int) -> int:
    """The largest seq_len <= ``wanted`` that ``repeated_random_tokens`` can build for this model.

    Example:
        >>> fitting_seq_len(model, 25), fitting_seq_len(model, 500)   # n_ctx 256 holds 1 + 2 * 127 tokens
        (25, 127)
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
        >>> scores_LH = induction_scores(model, seq_len=20, batch=4)
        >>> top_heads(scores_LH, 3).round(2)   # toy-attn-2l's induction heads are in layer 1
           layer  head  score
        0      1     0   0.88
        1      1     1   0.86
        2      1     2   0.74
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
        >>> df = induction_loss(model, seq_len=20, batch=4)
        >>> df.groupby("copy").loss.mean().round(1)
        copy
        first     7.8
        second    1.2
        Name: loss, dtype: float64
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
        >>> {name: round(loss, 1) for name, loss in copy_losses(model, seq_len=20, batch=4).items()}
        {'first_copy': 7.8, 'second_copy': 0.8}
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


@torch.no_grad()
def induction_per_prompt(model, tokens: Tensor, seq_len: int) -> pd.DataFrame:
    """Each prompt's induction score per head on repeated random tokens [B, 1 + 2*seq_len]: DataFrame[prompt, layer, head, score].

    The mean over prompts is ``induction_scores`` (the same stripe, ``experiments.induction.induction_stripe``).

    Example:
        >>> rows = induction_per_prompt(model, repeated_random_tokens(model, 20, batch=4), 20)
        >>> rows.shape, round(float(rows.groupby(["layer", "head"]).score.mean().max()), 2)   # 4 prompts x 8 heads
        ((32, 4), 0.88)
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
        >>> rows = induction_loss_per_prompt(model, repeated_random_tokens(model, 20, batch=4), 20)
        >>> rows.shape, rows.columns.tolist()   # 4 prompts x 2 copies x 20 positions
        ((160, 4), ['prompt', 'position', 'copy', 'loss'])
    """
    loss_BP = model(tokens, return_type="loss", loss_per_token=True).float().cpu()
    B = tokens.shape[0]
    return pd.DataFrame({"prompt": np.repeat(np.arange(B), 2 * seq_len), "position": np.tile(np.arange(seq_len), 2 * B),
                         "copy": np.tile(["first"] * seq_len + ["second"] * seq_len, B),
                         "loss": loss_BP.reshape(-1).numpy()})


if __name__ == "__main__":  # the command line lives in experiments.cli.induction
    from experiments._cli import run_command

    run_command("induction")
