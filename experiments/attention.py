"""Attention patterns of one prompt by layer and head, and per-head statistics.

Legend: B batch, P position, S key position, H n_heads, L n_layers.

Their figures are ``experiments.plots.attention``. ``python -m experiments.attention --model NAME
--out DIR [--prompt TEXT]`` (``experiments.cli.attention``) writes the per-head summary (CSV/JSON)
and the layer x head grid of patterns (HTML).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from workbench.tokens_api import TextOrTokens
from workbench.errors import InputError


@torch.no_grad()
def attention_patterns(model, tokens: TextOrTokens) -> Float[Tensor, "n_layers n_heads pos key_pos"]:
    """Every head's attention pattern on one prompt (batch item 0), stacked over layers.

    Layers whose pattern is hooked run the eager kernel, so this works under every attn_impl.

    Example:
        >>> patterns_LHPS = attention_patterns(model, tokens)
        >>> patterns_LHPS.shape     # [n_layers, n_heads, q, k]
        torch.Size([2, 4, 14, 14])
        >>> patterns_LHPS.sum(-1).allclose(torch.ones(2, 4, 14))   # each query's attention sums to 1
        True
    """
    tokens_1P = model.as_tokens(tokens)[:1]
    patterns: list[Tensor] = [None] * model.cfg.n_layers  # type: ignore[list-item]

    def keep(pattern_BHPS: Tensor, hook) -> None:
        patterns[hook.layer()] = pattern_BHPS[0].detach().float()

    hooks = [(f"blocks.{layer}.attn.hook_pattern", keep) for layer in range(model.cfg.n_layers)]
    model.run_with_hooks(tokens_1P, return_type=None, fwd_hooks=hooks)
    return torch.stack(patterns)


def previous_token_attention(pattern_PS: Float[Tensor, "... pos key_pos"]) -> Float[Tensor, "... pos_minus_1"]:
    """Attention from each query q >= 1 to the key q - 1.

    Example:
        >>> previous_token_attention(torch.tensor([[1.0, 0.0], [0.25, 0.75]])).tolist()
        [0.25]
    """
    return pattern_PS.diagonal(offset=-1, dim1=-2, dim2=-1)


@torch.no_grad()
def prev_token_share(model, tokens: TextOrTokens) -> Float[Tensor, "n_layers n_heads"]:
    """``head_statistics``' prev_token_share over a batch: mean attention to the previous position
    over every query q >= 1 of every row of ``tokens``.

    (``experiments.detectors.previous_token_scores`` is TransformerLens's "mul" score instead,
    which divides by every query, position 0 included.)

    Example:
        >>> scores_LH = prev_token_share(model, model.to_tokens(["x = 1", "y = 2"]))
        >>> scores_LH.shape, scores_LH[0].argmax().item()   # L0H0 is toy-attn-2l's previous-token head
        (torch.Size([2, 4]), 0)
    """
    tokens_BP = model.as_tokens(tokens)
    scores = torch.zeros(model.cfg.n_layers, model.cfg.n_heads)

    def score_layer(pattern_BHPS: Tensor, hook) -> None:
        scores[hook.layer()] = previous_token_attention(pattern_BHPS.float()).mean((0, 2)).cpu()

    model.run_with_hooks(tokens_BP, return_type=None,
                         fwd_hooks=[(f"blocks.{l}.attn.hook_pattern", score_layer) for l in range(model.cfg.n_layers)])
    return scores


def head_statistics(
    patterns_LHPS: Float[Tensor, "n_layers n_heads pos key_pos"],
) -> dict[str, Float[Tensor, "n_layers n_heads"]]:
    """Entropy (nats), attention to position 0, previous-token share and mean distance per head.

    Each is a mean over query positions: entropy over all queries; previous-token share over
    queries 1.. (query 0 has no previous token); distance is sum_k p[q, k] * (q - k).

    Example:
        >>> uniform = torch.tril(torch.ones(3, 3)); uniform = uniform / uniform.sum(-1, keepdim=True)
        >>> stats = head_statistics(uniform[None, None])
        >>> round(stats["prev_token_share"].item(), 4)   # (1/2 + 1/3) / 2
        0.4167
    """
    p = patterns_LHPS.float()
    if p.ndim != 4 or p.shape[-1] != p.shape[-2]:
        raise InputError(f"expected patterns [n_layers, n_heads, q, k] with q == k, got shape {tuple(p.shape)}")
    P = p.shape[-1]
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean(-1)
    bos = p[..., :, 0].mean(-1)
    prev = previous_token_attention(p).mean(-1) if P > 1 else torch.zeros_like(bos)
    positions = torch.arange(P, device=p.device)
    distance_PS = (positions[:, None] - positions[None, :]).clamp_min(0).float()
    mean_distance = (p * distance_PS).sum(-1).mean(-1)
    return {"entropy": entropy, "bos_attention": bos, "prev_token_share": prev, "mean_distance": mean_distance}


def head_summary(
    patterns: Float[Tensor, "n_layers n_heads pos key_pos"],
    tokens: Optional[Int[Tensor, "pos"]] = None,
) -> pd.DataFrame:
    """One row per (layer, head): entropy, bos_attention, prev_token_share, mean_distance.

    With ``tokens`` (the prompt's ids, [pos] or [1, pos]) a ``duplicate_token_share`` column is
    added: the mean attention each query pays to earlier copies of its own token.

    Example:
        >>> df = head_summary(attention_patterns(model, tokens), tokens)
        >>> df.columns.tolist()
        ['layer', 'head', 'entropy', 'bos_attention', 'prev_token_share', 'mean_distance', 'duplicate_token_share']
        >>> df.sort_values("prev_token_share").tail(2)[["layer", "head", "prev_token_share"]].round(2)
           layer  head  prev_token_share
        2      0     2              0.27
        0      0     0              0.76
    """
    stats = head_statistics(patterns)
    L, H = stats["entropy"].shape
    table = pd.DataFrame({
        "layer": np.repeat(np.arange(L), H),
        "head": np.tile(np.arange(H), L),
        **{name: _flat_numpy(values) for name, values in stats.items()},
    })
    if tokens is not None:
        toks = tokens.reshape(-1).to(patterns.device)
        if toks.numel() != patterns.shape[-1]:
            raise InputError(f"tokens have {toks.numel()} positions but the patterns have {patterns.shape[-1]}")
        same_PS = torch.tril(toks[:, None] == toks[None, :], diagonal=-1).float()
        table["duplicate_token_share"] = _flat_numpy((patterns.float() * same_PS).sum(-1).mean(-1))
    return table


def _flat_numpy(values_LH: Tensor) -> np.ndarray:
    """A [n_layers, n_heads] float tensor as a flat float32 array, layer-major (a table column)."""
    return values_LH.detach().float().cpu().numpy().reshape(-1)


if __name__ == "__main__":  # the command line lives in experiments.cli.attention
    from experiments._cli import run_command

    run_command("attention")
