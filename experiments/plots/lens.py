"""Figures of ``experiments.lens``: the logit lens grid and the direct logit attribution chart.

Legend: P position.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from torch import Tensor

from experiments._tokens import axis_labels, chart_text
from experiments.plots.common import colorscale_json, labelled_heatmap
from workbench.errors import InputError


def _row_labels(str_toks: Sequence, row: int, attention_mask: Optional[Tensor]) -> list[str]:
    """One prompt's token labels from one list or one list per prompt, its pads dropped under ``attention_mask``."""
    labels = list(str_toks)
    if labels and isinstance(labels[0], (list, tuple)):  # one list per prompt
        if not -len(labels) <= row < len(labels):
            raise InputError(f"row={row} is outside the {len(labels)} prompts of str_toks")
        labels = list(labels[row])
    if attention_mask is None:
        return labels
    mask = torch.as_tensor(attention_mask)
    mask = mask if mask.ndim == 1 else mask[row]
    if len(mask) != len(labels):
        raise InputError(f"attention_mask has {len(mask)} positions but str_toks {len(labels)}; they must match")
    return [label for label, real in zip(labels, mask.bool().tolist()) if real]


def logit_lens_figure(df: pd.DataFrame, str_toks: Optional[Sequence] = None, row: int = 0,
                      attention_mask: Optional[Tensor] = None) -> go.Figure:
    """Layer x position grid of each snapshot's top-1 token, coloured by its probability (the positions ``df`` read).

    ``str_toks``: the prompt's token labels, or one list per prompt of a padded batch (``row``
    picks one); with ``attention_mask`` ([P] or [B, P]) the row's pad labels are dropped, as
    ``logit_lens`` dropped its pad positions.

    Example:
        >>> from experiments.lens import logit_lens
        >>> logit_lens_figure(logit_lens(model, tokens), model.to_str_tokens(tokens)).data[0].z.shape   # snapshot x position
        (3, 14)
        >>> toks = model.to_tokens(["The cat sat", "The cat"])   # right-padded: row 1 has 2 pads
        >>> mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
        >>> fig = logit_lens_figure(logit_lens(model, toks, row=1, attention_mask=mask), model.to_str_tokens(toks), 1, mask)
        >>> fig.data[0].x
        ("0: '&lt;|endoftext|&gt;'", "1: 'The'", "2: ' c'", "3: 'at'")
        >>> logit_lens_figure(logit_lens(model, tokens, positions=[12, 13]), model.to_str_tokens(tokens)).data[0].x
        ("12: ' c'", "13: 'at'")
    """
    top = df[df["rank"] == 1]
    prob = top.pivot(index="layer", columns="position", values="prob")
    token = top.pivot(index="layer", columns="position", values="token")
    n_layers = int(top["layer"].max())
    y_labels = [f"resid_pre {l}" if l < n_layers else "final" for l in prob.index]
    if str_toks is not None:
        labels = _row_labels(str_toks, row, attention_mask)
        n_prompt = df.attrs.get("prompt_positions", prob.shape[1])  # a table of some positions names the prompt's length
        if len(labels) != n_prompt:
            raise InputError(f"str_toks has {len(labels)} tokens but the logit lens {n_prompt} positions; pass the "
                             f"row's tokens (and attention_mask to drop its pads)")
        x_labels = [axis_labels(labels)[p] for p in prob.columns]
    else:
        x_labels = [str(p) for p in prob.columns]
    text = [[chart_text(str(t)[:10]) for t in row_tokens] for row_tokens in token.values]
    fig = labelled_heatmap(prob.values, x_labels, y_labels, title="Logit lens: top token per layer and position",
                           x_title="position", y_title="layer", value_name="prob", text=text, colorscale="Blues")
    fig.update_traces(zmin=0, zmax=1, textfont=dict(size=9))
    fig.update_layout(height=max(400, 22 * len(y_labels) + 150), width=max(600, 70 * len(x_labels) + 200))
    return fig


def dla_figure(df: pd.DataFrame, title: str = "Direct logit attribution") -> go.Figure:
    """Heads as a layer x head heatmap beside a bar chart of the other components.

    Example:
        >>> from experiments.lens import direct_logit_attribution
        >>> fig = dla_figure(direct_logit_attribution(model, tokens, model.to_single_token(" s")))
        >>> fig.data[0].z.shape, list(fig.data[1].x)   # heads (layer x head) beside the other components
        ((2, 4), ['embed', 'ln_final_bias'])
    """
    heads = df[df.component == "head"].pivot(index="layer", columns="head", values="attribution")
    others = df[df.component != "head"]
    labels = [c if l < 0 else f"{c} {l}" for c, l in zip(others.component, others.layer)]
    bound = float(np.nanmax(np.abs(heads.values))) if heads.size else 1.0
    values = others.attribution.to_numpy(dtype=float)
    # Two panels laid out as plotly's make_subplots(1, 2, column_widths=[0.45, 0.55]) lays them, the figure built
    # unvalidated: make_subplots and the validation of each trace were 20-30 ms of a Logit lens prompt change.
    traces = [
        dict(type="heatmap", z=heads.to_numpy(dtype=float), x=list(heads.columns), y=list(heads.index),
             colorscale=colorscale_json("RdBu"), zmid=0, zmin=-bound, zmax=bound, colorbar=dict(title=dict(text="logit"), x=0.42),
             hovertemplate="L%{y}H%{x}<br>attribution=%{z:.4f}<extra></extra>", xaxis="x", yaxis="y"),
        dict(type="bar", x=labels, y=values, marker=dict(color=np.where(values >= 0, "#2166ac", "#b2182b").tolist()),
             hovertemplate="%{x}<br>attribution=%{y:.4f}<extra></extra>", showlegend=False, xaxis="x2", yaxis="y2"),
    ]
    panel_title = dict(font=dict(size=16), showarrow=False, xanchor="center", xref="paper", y=1.0, yanchor="bottom",
                       yref="paper")
    total = df.attrs.get("logit_diff")
    layout = dict(
        title=dict(text=title + (f" (total {total:.3f})" if total is not None else "")),
        height=max(400, 20 * heads.shape[0] + 200), width=1100,
        xaxis=dict(anchor="y", domain=[0.0, 0.405], title=dict(text="head")),
        yaxis=dict(anchor="x", domain=[0.0, 1.0], autorange="reversed", title=dict(text="layer")),
        xaxis2=dict(anchor="y2", domain=[0.505, 1.0]), yaxis2=dict(anchor="x2", domain=[0.0, 1.0]),
        annotations=[dict(panel_title, text="heads", x=0.2025), dict(panel_title, text="other components", x=0.7525)],
    )
    return go.Figure(data=traces, layout=layout, _validate=False)
