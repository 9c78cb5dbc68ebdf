"""Plotly helpers shared by the experiment modules and the dashboard.

Legend: H n_heads, L n_layers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Float
from torch import Tensor

from workbench.errors import InputError


def to_numpy(values) -> np.ndarray:
    """A tensor (any device, with or without grad), array or nested list as a float numpy array."""
    if isinstance(values, Tensor):
        return values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=float)


def scores_heatmap(
    scores_LH: Float[Tensor, "n_layers n_heads"],
    title: str = "",
    colorscale: str = "Blues",
    zmid: Optional[float] = None,
    value_name: str = "score",
) -> go.Figure:
    """A layer x head heatmap (layer 0 at the top) with a hover naming the head and its value.

    Pass ``zmid=0`` and a diverging colorscale (e.g. "RdBu") for signed values such as loss changes.

    Example:
        >>> fig = scores_heatmap(torch.rand(2, 4), "induction score")
        >>> fig.data[0].z.shape
        (2, 4)
    """
    z = to_numpy(scores_LH)
    if z.ndim != 2:
        raise InputError(f"scores_heatmap expects a [n_layers, n_heads] array, got shape {z.shape}")
    n_layers, n_heads = z.shape
    text = [[f"L{l}H{h}" for h in range(n_heads)] for l in range(n_layers)]
    heatmap = go.Heatmap(
        z=z, x=list(range(n_heads)), y=list(range(n_layers)), colorscale=colorscale, zmid=zmid,
        text=text, hovertemplate="%{text}<br>" + value_name + "=%{z:.4f}<extra></extra>",
        colorbar=dict(title=value_name),
    )
    fig = go.Figure(heatmap)
    fig.update_layout(title=title, xaxis_title="head", yaxis_title="layer",
                      height=max(300, 22 * n_layers + 120), width=max(400, 40 * n_heads + 200))
    fig.update_yaxes(autorange="reversed", dtick=1 if n_layers <= 40 else None)
    fig.update_xaxes(dtick=1 if n_heads <= 40 else None)
    return fig


def labelled_heatmap(
    z: np.ndarray,
    x_labels: Sequence[str],
    y_labels: Sequence[str],
    title: str = "",
    colorscale: str = "Blues",
    zmid: Optional[float] = None,
    x_title: str = "",
    y_title: str = "",
    value_name: str = "value",
    text: Optional[Sequence[Sequence[str]]] = None,
) -> go.Figure:
    """A heatmap over numeric axes with text tick labels (so repeated labels stay separate).

    Example:
        >>> labelled_heatmap(np.eye(2), ["a", "a"], ["x", "y"]).data[0].z.shape
        (2, 2)
    """
    z = np.asarray(z, dtype=float)
    hover_x = [[x_labels[j] for j in range(z.shape[1])] for _ in range(z.shape[0])]
    hover_y = [[y_labels[i]] * z.shape[1] for i in range(z.shape[0])]
    custom = np.dstack([np.array(hover_y, dtype=object), np.array(hover_x, dtype=object)])
    heatmap = go.Heatmap(
        z=z, x=list(range(z.shape[1])), y=list(range(z.shape[0])), colorscale=colorscale, zmid=zmid,
        customdata=custom, colorbar=dict(title=value_name),
        hovertemplate=f"{y_title or 'y'}: %{{customdata[0]}}<br>{x_title or 'x'}: %{{customdata[1]}}"
                      f"<br>{value_name}=%{{z:.4f}}<extra></extra>",
        text=text, texttemplate="%{text}" if text is not None else None,
    )
    fig = go.Figure(heatmap)
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title)
    fig.update_xaxes(tickmode="array", tickvals=list(range(len(x_labels))), ticktext=list(x_labels))
    fig.update_yaxes(tickmode="array", tickvals=list(range(len(y_labels))), ticktext=list(y_labels),
                     autorange="reversed")
    return fig


def signed_token_bars(
    df: pd.DataFrame,
    value: str,
    title: str = "",
    value_name: str = "change",
    x_title: str = "token",
    hover: Sequence[str] = (),
) -> go.Figure:
    """One bar per row of ``df`` (labelled "position: token" from its columns), red above zero, blue below.

    For per-token changes such as the loss change of an ablation; ``hover`` names more columns
    shown on hover.

    Example:
        >>> df = pd.DataFrame({"position": [0, 1], "token": ["a", "b"], "delta": [0.5, -0.25]})
        >>> fig = signed_token_bars(df, "delta", value_name="loss change")
        >>> list(fig.data[0].x), list(fig.data[0].marker.color)
        (["0: 'a'", "1: 'b'"], ['#b2182b', '#2166ac'])
    """
    import plotly.express as px  # imported here: it is slow to import and only this helper needs it

    labels = [f"{p}: {t!r}"[:30] for p, t in zip(df["position"], df["token"])]
    fig = px.bar(df.assign(label=labels), x="label", y=value, hover_data=list(hover), title=title,
                 labels={"label": x_title, value: value_name})
    fig.update_traces(marker_color=["#b2182b" if v > 0 else "#2166ac" for v in df[value]])
    return fig
