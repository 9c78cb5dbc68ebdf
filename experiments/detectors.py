"""Previous-token, duplicate-token and induction head detectors on any tokens.

Legend: B batch, L n_layers, H n_heads, P position, S key position.

Scores follow `transformer_lens.head_detector.detect_head` with ``error_measure="mul"``: a 0/1
detection pattern D [P, S] marks the query-key pairs a head of that kind attends to, and a
head's score is sum(A * D) / sum(A) over its pattern A; ``exclude_bos`` zeroes A's first column
and ``exclude_current_token`` its diagonal before both sums. A batch is scored sequence by
sequence and averaged, as ``detect_head`` does for a list of prompts (so the rows of a batch
should be unpadded sequences of one length).

``python -m experiments.detectors --model NAME --out DIR [--prompt TEXT]`` (``experiments.cli.detectors``)
writes all three scores.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from workbench.tokens_api import TextOrTokens
from workbench.errors import InputError

HeadKind = Literal["previous_token", "duplicate_token", "induction"]
HEAD_KINDS: tuple[HeadKind, ...] = ("previous_token", "duplicate_token", "induction")


def detection_patterns(kind: HeadKind, tokens_BP: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos key_pos"]:
    """The 0/1 pattern a perfect head of ``kind`` would have, per sequence.

    previous_token: D[q, q-1] = 1. duplicate_token: D[q, k] = 1 for earlier k with the same
    token. induction: D[q, k] = 1 where the token before k equals the token at q (k <= q).

    Example:
        >>> detection_patterns("induction", torch.tensor([[7, 1, 2, 1, 2]]))[0, 3].tolist()
        [0.0, 0.0, 1.0, 0.0, 0.0]
    """
    B, P = tokens_BP.shape
    if kind == "previous_token":
        return torch.diag_embed(torch.ones(B, P - 1, device=tokens_BP.device), offset=-1)
    same_BPS = tokens_BP[:, :, None] == tokens_BP[:, None, :]
    duplicate_BPS = torch.tril(same_BPS, diagonal=-1).float()
    if kind == "duplicate_token":
        return duplicate_BPS
    if kind == "induction":
        shifted_BPS = torch.zeros_like(duplicate_BPS)
        shifted_BPS[:, :, 1:] = same_BPS[:, :, :-1].float()  # key k is scored by the token before it, k-1
        return torch.tril(shifted_BPS)
    raise InputError(f"unknown head kind {kind!r}; choose one of {HEAD_KINDS}")


def score_patterns(
    pattern_BHPS: Float[Tensor, "batch n_heads pos key_pos"],
    detection_BPS: Float[Tensor, "batch pos key_pos"],
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
) -> Float[Tensor, "n_heads"]:
    """The "mul" score of each head, averaged over the batch.

    Example:
        >>> prev = torch.tensor([[[[1., 0.], [1., 0.]]]])                   # query 1 looks at key 0
        >>> score_patterns(prev, detection_patterns("previous_token", torch.zeros(1, 2, dtype=torch.long))).item()
        0.5
    """
    A = pattern_BHPS.float()
    if exclude_bos or exclude_current_token:
        A = A.clone()
        if exclude_bos:
            A[..., 0] = 0
        if exclude_current_token:
            A.diagonal(dim1=-2, dim2=-1).zero_()
    matched_BH = (A * detection_BPS[:, None].to(A.device)).sum((-1, -2))
    return (matched_BH / A.sum((-1, -2))).mean(0)


@torch.no_grad()
def head_detector_scores(
    model,
    tokens: TextOrTokens,
    kinds: Sequence[HeadKind] = HEAD_KINDS,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
) -> dict[HeadKind, Float[Tensor, "n_layers n_heads"]]:
    """Several detectors from one forward pass (each layer's pattern is scored as it is computed).

    Example:
        >>> scores = head_detector_scores(model, tokens)
        >>> {kind: divmod(int(scores_LH.argmax()), model.cfg.n_heads) for kind, scores_LH in scores.items()}
        {'previous_token': (0, 0), 'duplicate_token': (0, 2), 'induction': (1, 3)}
    """
    tokens_BP = model.as_tokens(tokens)
    if tokens_BP.shape[1] < 2:
        raise InputError("the detectors need at least two tokens")
    detections = {kind: detection_patterns(kind, tokens_BP) for kind in kinds}
    L, H = model.cfg.n_layers, model.cfg.n_heads
    scores = {kind: torch.zeros(L, H) for kind in kinds}

    def score_layer(pattern_BHPS: Tensor, hook) -> None:
        for kind, detection in detections.items():
            scores[kind][hook.layer()] = score_patterns(pattern_BHPS, detection, exclude_bos, exclude_current_token).cpu()

    model.run_with_hooks(tokens_BP, return_type=None,
                         fwd_hooks=[(f"blocks.{l}.attn.hook_pattern", score_layer) for l in range(L)])
    return scores


def previous_token_scores(model, tokens: TextOrTokens, exclude_bos: bool = False,
                          exclude_current_token: bool = False) -> Float[Tensor, "n_layers n_heads"]:
    """How much of each head's attention goes to the previous token ("mul" metric).

    Example:
        >>> previous_token_scores(model, tokens).round(decimals=2)
        tensor([[0.7100, 0.0300, 0.2500, 0.1400],
                [0.0200, 0.0800, 0.1500, 0.2100]])
    """
    return head_detector_scores(model, tokens, ("previous_token",), exclude_bos, exclude_current_token)["previous_token"]


def duplicate_token_scores(model, tokens: TextOrTokens, exclude_bos: bool = False,
                           exclude_current_token: bool = False) -> Float[Tensor, "n_layers n_heads"]:
    """How much of each head's attention goes to earlier copies of the current token.

    Example:
        >>> from experiments.induction import repeated_random_tokens
        >>> duplicate_token_scores(model, repeated_random_tokens(model, 20, batch=1)).max() < 0.05   # none in toy-attn-2l
        tensor(True)
    """
    return head_detector_scores(model, tokens, ("duplicate_token",), exclude_bos, exclude_current_token)["duplicate_token"]


def induction_head_scores(model, tokens: TextOrTokens, exclude_bos: bool = False,
                          exclude_current_token: bool = False) -> Float[Tensor, "n_layers n_heads"]:
    """How much of each head's attention goes to tokens that followed earlier copies of the current token.

    Example:
        >>> from experiments.induction import repeated_random_tokens
        >>> induction_head_scores(model, repeated_random_tokens(model, 20, batch=1), exclude_bos=True).round(decimals=2)
        tensor([[0.0000, 0.0000, 0.0000, 0.0100],
                [0.4600, 0.8000, 0.8000, 0.8300]])
    """
    return head_detector_scores(model, tokens, ("induction",), exclude_bos, exclude_current_token)["induction"]


def scores_table(scores: dict[str, Float[Tensor, "n_layers n_heads"]]) -> pd.DataFrame:
    """Long table [layer, head, <one column per score>].

    Example:
        >>> scores_table({"induction": torch.zeros(2, 3)}).shape
        (6, 3)
    """
    first = next(iter(scores.values()))
    L, H = first.shape
    return pd.DataFrame({"layer": np.repeat(np.arange(L), H), "head": np.tile(np.arange(H), L),
                         **{name: values.reshape(-1).float().numpy() for name, values in scores.items()}})


if __name__ == "__main__":  # the command line lives in experiments.cli.detectors
    from experiments._cli import run_command

    run_command("detectors")
