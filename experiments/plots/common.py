"""Plotly helpers shared by the experiments' figures and the dashboard: heatmaps, signed bars, arrays.

Legend: H n_heads, L n_layers.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from jaxtyping import Float
from torch import Tensor

from experiments._tokens import chart_text
from workbench.errors import InputError


def to_numpy(values) -> np.ndarray:
    """A tensor (any device, with or without grad), array or nested list as a float numpy array.

    Example:
        >>> to_numpy(torch.tensor([1, 2])).tolist(), to_numpy([[0.5, 1]]).dtype
        ([1.0, 2.0], dtype('float64'))
    """
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


@functools.cache
def colorscale_json(name: str) -> list:
    """Plotly's named colour scale as a figure's JSON spells it, for figures built unvalidated (``_validate=False``,
    which skips plotly's expansion of the name): plotly.js reads some names the other way round ("Blues" runs dark to
    light there).

    Example:
        >>> colorscale_json("Blues")[0], colorscale_json("Blues")[-1]
        ([0.0, 'rgb(247,251,255)'], [1.0, 'rgb(8,48,107)'])
    """
    return [[position, colour] for position, colour in _named_colorscale(name)]


@functools.cache  # the one read of a named scale; plotly parses and validates the name each time
def _named_colorscale(name: str) -> tuple[tuple[float, str], ...]:
    return tuple((float(position), colour)
                 for position, colour in go.layout.Coloraxis(colorscale=name).to_plotly_json()["colorscale"])


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
    """A heatmap with text labels on both axes (repeated labels stay separate), hover naming both and the value.

    The axes are categories: a repeated label gets invisible zero-width spaces appended, so plotly
    keeps its rows apart. The hover reads the axis labels, so no per-cell text travels to the
    browser (a per-cell label array made a 64-token pattern take 0.2-0.4 s to draw in Chromium).
    Float32 values stay float32 (4 bytes a cell in the figure's binary array); any other values become float64.

    Example:
        >>> fig = labelled_heatmap(np.eye(2), ["a", "a"], ["x", "y"])
        >>> fig.data[0].z.shape, [len(x) for x in fig.data[0].x]
        ((2, 2), [1, 2])
        >>> labelled_heatmap(np.eye(2, dtype=np.float32), ["a", "b"], ["x", "y"]).data[0].z.dtype
        dtype('float32')
    """
    z = np.asarray(z)
    z = z if z.dtype == np.float32 else z.astype(float)  # float32 values travel as float32: half the bytes
    heatmap = go.Heatmap(
        z=z, x=distinct_labels(x_labels), y=distinct_labels(y_labels), colorscale=colorscale, zmid=zmid,
        colorbar=dict(title=value_name),
        hovertemplate=f"{y_title or 'y'}: %{{y}}<br>{x_title or 'x'}: %{{x}}<br>{value_name}=%{{z:.4f}}<extra></extra>",
        text=text, texttemplate="%{text}" if text is not None else None,
    )
    fig = go.Figure(heatmap)
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title)
    fig.update_xaxes(type="category")
    fig.update_yaxes(type="category", autorange="reversed")
    return fig


def distinct_labels(labels: Sequence[str]) -> list[str]:
    """``labels`` with each repeat made distinct by trailing zero-width spaces (they look the same on screen).

    Example:
        >>> [len(label) for label in distinct_labels(["a", "b", "a", "a"])]
        [1, 1, 2, 3]
    """
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        label = str(label)
        out.append(label + "\u200b" * seen.get(label, 0))
        seen[label] = seen.get(label, 0) + 1
    return out


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

    labels = [chart_text(f"{p}: {t!r}"[:30]) for p, t in zip(df["position"], df["token"])]
    fig = px.bar(df.assign(label=labels), x="label", y=value, hover_data=list(hover), title=title,
                 labels={"label": x_title, value: value_name})
    fig.update_traces(marker_color=["#b2182b" if v > 0 else "#2166ac" for v in df[value]])
    return fig
