"""Attention patterns of one prompt by layer and head, per-head statistics and figures.

Legend: L layers, H heads, Q query positions, K key positions.

``python -m experiments.attention --model NAME --out DIR [--prompt TEXT]`` writes the per-head
summary (CSV/JSON) and the layer x head grid of patterns (HTML).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Float, Int
from plotly.subplots import make_subplots
from torch import Tensor

from experiments._tokens import TokensLike, as_batch, axis_labels, str_tokens
from experiments.figures import labelled_heatmap, to_numpy
from workbench.errors import InputError


@torch.no_grad()
def attention_patterns(model, tokens: TokensLike) -> Float[Tensor, "n_layers n_heads q_pos k_pos"]:
    """Every head's attention pattern on one prompt (batch item 0), stacked over layers.

    Layers whose pattern is hooked run the eager kernel, so this works under every attn_impl.

    Example:
        >>> patterns_LHQK = attention_patterns(model, model.to_tokens("The cat sat"))   # doctest: +SKIP
        >>> patterns_LHQK.shape     # [n_layers, n_heads, q, k]                          # doctest: +SKIP
    """
    tokens_1P = as_batch(model, tokens)[:1]
    patterns: list[Tensor] = [None] * model.cfg.n_layers  # type: ignore[list-item]

    def keep(pattern_BHQK: Tensor, hook) -> None:
        patterns[int(hook.name.split(".")[1])] = pattern_BHQK[0].detach().float()

    hooks = [(f"blocks.{layer}.attn.hook_pattern", keep) for layer in range(model.cfg.n_layers)]
    model.run_with_hooks(tokens_1P, return_type=None, fwd_hooks=hooks)
    return torch.stack(patterns)


def head_statistics(
    patterns_LHQK: Float[Tensor, "n_layers n_heads q_pos k_pos"],
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
    p = patterns_LHQK.float()
    if p.ndim != 4 or p.shape[-1] != p.shape[-2]:
        raise InputError(f"expected patterns [n_layers, n_heads, q, k] with q == k, got shape {tuple(p.shape)}")
    Q = p.shape[-1]
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean(-1)
    bos = p[..., :, 0].mean(-1)
    prev = p.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1) if Q > 1 else torch.zeros_like(bos)
    q_idx = torch.arange(Q, device=p.device)
    distance_QK = (q_idx[:, None] - q_idx[None, :]).clamp_min(0).float()
    mean_distance = (p * distance_QK).sum(-1).mean(-1)
    return {"entropy": entropy, "bos_attention": bos, "prev_token_share": prev, "mean_distance": mean_distance}


def head_summary(
    patterns: Float[Tensor, "n_layers n_heads q_pos k_pos"],
    tokens: Optional[Int[Tensor, "pos"]] = None,
) -> pd.DataFrame:
    """One row per (layer, head): entropy, bos_attention, prev_token_share, mean_distance.

    With ``tokens`` (the prompt's ids, [pos] or [1, pos]) a ``duplicate_token_share`` column is
    added: the mean attention each query pays to earlier copies of its own token.

    Example:
        >>> df = head_summary(attention_patterns(model, tokens), tokens)   # doctest: +SKIP
        >>> df.sort_values("prev_token_share").tail(3)                     # doctest: +SKIP
    """
    stats = head_statistics(patterns)
    L, H = stats["entropy"].shape
    table = pd.DataFrame({
        "layer": np.repeat(np.arange(L), H),
        "head": np.tile(np.arange(H), L),
        **{name: to_numpy(values).reshape(-1) for name, values in stats.items()},
    })
    if tokens is not None:
        toks = tokens.reshape(-1).to(patterns.device)
        if toks.numel() != patterns.shape[-1]:
            raise InputError(f"tokens have {toks.numel()} positions but the patterns have {patterns.shape[-1]}")
        same_QK = torch.tril(toks[:, None] == toks[None, :], diagonal=-1).float()
        table["duplicate_token_share"] = to_numpy((patterns.float() * same_QK).sum(-1).mean(-1)).reshape(-1)
    return table


def pattern_figure(pattern_QK: Float[Tensor, "q_pos k_pos"], str_tokens: Sequence[str], title: str = "") -> go.Figure:
    """One head's pattern as a heatmap: queries down, keys across, token labels on both axes.

    Example:
        >>> fig = pattern_figure(patterns_LHQK[3, 4], model.to_str_tokens(tokens), "L3H4")   # doctest: +SKIP
    """
    z = to_numpy(pattern_QK)
    if z.ndim != 2 or z.shape[0] != len(str_tokens) or z.shape[1] != len(str_tokens):
        raise InputError(f"pattern of shape {z.shape} does not match {len(str_tokens)} tokens")
    labels = axis_labels(list(str_tokens))
    fig = labelled_heatmap(z, labels, labels, title=title, x_title="key", y_title="query",
                           value_name="attention", colorscale="Blues")
    fig.update_layout(height=max(350, 18 * len(labels) + 150), width=max(450, 18 * len(labels) + 250))
    return fig


def pattern_grid_figure(
    patterns_LHQK: Float[Tensor, "n_layers n_heads q_pos k_pos"],
    str_tokens: Optional[Sequence[str]] = None,
    layers: Optional[Sequence[int]] = None,
) -> go.Figure:
    """A layer x head grid of small pattern heatmaps, drawn as one tiled heatmap (fast even for 270 heads).

    Tiles are separated by blank gaps; the hover names layer, head, query and key positions, and
    the title lists the tokens by position.

    Example:
        >>> pattern_grid_figure(attention_patterns(model, tokens), layers=[0, 1, 2])   # doctest: +SKIP
    """
    p = to_numpy(patterns_LHQK)
    if p.ndim != 4:
        raise InputError(f"expected patterns [n_layers, n_heads, q, k], got shape {p.shape}")
    layers = list(range(p.shape[0])) if layers is None else list(layers)
    n_heads, Q, K = p.shape[1], p.shape[2], p.shape[3]
    gap = max(1, Q // 8)
    rows, cols = len(layers) * (Q + gap) - gap, n_heads * (K + gap) - gap
    z = np.full((rows, cols), np.nan)
    # customdata per cell: layer, head, query, key (numeric, so building it is vectorised).
    custom = np.full((rows, cols, 4), np.nan)
    q_grid, k_grid = np.meshgrid(np.arange(Q), np.arange(K), indexing="ij")
    for r, layer in enumerate(layers):
        for h in range(n_heads):
            top, left = r * (Q + gap), h * (K + gap)
            z[top:top + Q, left:left + K] = p[layer, h]
            custom[top:top + Q, left:left + K] = np.stack(
                [np.full_like(q_grid, layer), np.full_like(q_grid, h), q_grid, k_grid], axis=-1)
    template = "L%{customdata[0]}H%{customdata[1]}<br>query %{customdata[2]}<br>key %{customdata[3]}"
    title = "Attention patterns (rows: layers, columns: heads)"
    if str_tokens is not None:
        if len(str_tokens) != K:
            raise InputError(f"{len(str_tokens)} string tokens for patterns over {K} positions")
        # Per-cell token hovers would weigh megabytes for a 270-head grid; the positions key is in the title.
        key = " ".join(f"{i}:{t!r}" for i, t in enumerate(str_tokens))
        title += "<br><sup>" + (key if len(key) <= 160 else key[:157] + "...") + "</sup>"
    fig = go.Figure(go.Heatmap(z=z, customdata=custom, colorscale="Blues", zmin=0, zmax=1,
                               hovertemplate=template + "<br>attention=%{z:.3f}<extra></extra>", hoverongaps=False,
                               colorbar=dict(title="attention")))
    fig.update_xaxes(tickmode="array", tickvals=[h * (K + gap) + K / 2 for h in range(n_heads)],
                     ticktext=[f"H{h}" for h in range(n_heads)], showgrid=False)
    fig.update_yaxes(tickmode="array", tickvals=[r * (Q + gap) + Q / 2 for r in range(len(layers))],
                     ticktext=[f"L{layer}" for layer in layers], autorange="reversed", showgrid=False)
    fig.update_layout(title=title,
                      height=max(400, 60 * len(layers) + 150), width=max(500, 70 * n_heads + 200),
                      plot_bgcolor="white")
    return fig


def layer_patterns_figure(
    patterns_HQK: Float[Tensor, "n_heads q_pos k_pos"], str_tokens: Sequence[str], layer: int
) -> go.Figure:
    """Every head of one layer side by side (up to four per row), token labels on the axes.

    Example:
        >>> layer_patterns_figure(attention_patterns(model, tokens)[2], model.to_str_tokens(tokens), 2)   # doctest: +SKIP
    """
    p = to_numpy(patterns_HQK)
    if p.ndim != 3:
        raise InputError(f"expected one layer's patterns [n_heads, q, k], got shape {p.shape}")
    n_heads = p.shape[0]
    n_cols = min(4, n_heads)
    n_rows = (n_heads + n_cols - 1) // n_cols
    labels = axis_labels(list(str_tokens))
    fig = make_subplots(rows=n_rows, cols=n_cols, subplot_titles=[f"L{layer}H{h}" for h in range(n_heads)],
                        horizontal_spacing=0.03, vertical_spacing=0.06)
    for h in range(n_heads):
        fig.add_trace(go.Heatmap(z=p[h], x=labels, y=labels, coloraxis="coloraxis",
                                 hovertemplate="query %{y}<br>key %{x}<br>attention=%{z:.3f}<extra></extra>"),
                      row=h // n_cols + 1, col=h % n_cols + 1)
    fig.update_yaxes(autorange="reversed", showticklabels=len(labels) <= 40)
    fig.update_xaxes(showticklabels=False)
    fig.update_layout(title=f"Layer {layer}: every head", coloraxis=dict(colorscale="Blues", cmin=0, cmax=1),
                      height=300 * n_rows + 100, width=300 * n_cols + 150)
    return fig


def main(argv: Optional[Sequence[str]] = None) -> None:
    from experiments import _cli

    parser = _cli.make_parser("Attention patterns of one prompt: per-head summary and the layer x head grid.")
    parser.add_argument("--prompt", default=None, help="text to run (default: a fixed example)")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    tokens_1P = _cli.prompt_tokens(model, args.prompt)
    patterns = attention_patterns(model, tokens_1P)
    labels = str_tokens(model, tokens_1P[0])
    table = head_summary(patterns, tokens_1P[0])
    _cli.write_outputs(args.out, "attention", table, pattern_grid_figure(patterns, labels),
                       {"experiment": "attention", "model": args.model, "str_tokens": labels})


if __name__ == "__main__":
    from experiments._cli import run_main

    run_main(main)
