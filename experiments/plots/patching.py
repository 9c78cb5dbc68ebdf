"""Figures of ``experiments.patching``: heatmaps of patching tables, and a layer x head map Streamlit can click."""

from __future__ import annotations

from typing import Optional

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from experiments._tokens import axis_labels
from experiments.plots.common import labelled_heatmap, scores_heatmap
from workbench.errors import InputError


def patching_heatmap(df: pd.DataFrame, title: str = "", value: Optional[str] = None) -> go.Figure:
    """Heatmap of a patching DataFrame: layer x head, or layer x position (one panel per component/site).

    ``value`` is the column to colour by (default: "normalized" when present, else "metric" or "attribution").

    Example:
        >>> from experiments.patching import patch_residual
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> fig = patching_heatmap(patch_residual(model, tokens, corrupt, " s", " and", progress=False), "residual stream")
        >>> fig.data[0].z.shape                         # layer x position
        (2, 14)
    """
    value = value or next(c for c in ("normalized", "attribution", "metric") if c in df.columns)
    if value not in df.columns:
        raise InputError(f"column {value!r} not in the DataFrame (columns: {list(df.columns)})")
    group_col = next((c for c in ("component", "site") if c in df.columns), None)
    groups = [(None, df)] if group_col is None else list(df.groupby(group_col, sort=False))
    by_head = "position" not in df.columns or all(g["position"].eq(-1).all() for _, g in groups)
    if by_head and len(groups) == 1:
        grid = df.pivot_table(index="layer", columns="head", values=value)
        return scores_heatmap(torch.tensor(grid.values), title, colorscale="RdBu", zmid=0.0, value_name=value)
    fig = make_subplots(rows=1, cols=len(groups), subplot_titles=[str(name or "") for name, _ in groups],
                        horizontal_spacing=0.08)
    labels = df.attrs.get("str_tokens")
    for i, (name, group) in enumerate(groups):
        column = "head" if group["position"].eq(-1).all() else "position"
        grid = group.pivot_table(index="layer", columns=column, values=value)
        sub = labelled_heatmap(grid.values, [(axis_labels(labels)[c] if labels and column == "position" else str(c))
                                             for c in grid.columns],
                               [str(l) for l in grid.index], colorscale="RdBu", zmid=0.0,
                               x_title=column, y_title="layer", value_name=value)
        trace = sub.data[0]
        trace.coloraxis = "coloraxis"
        fig.add_trace(trace, row=1, col=i + 1)
        fig.update_xaxes(tickmode="array", tickvals=list(range(len(grid.columns))),
                         ticktext=sub.layout.xaxis.ticktext, row=1, col=i + 1)
        fig.update_yaxes(autorange="reversed", title_text="layer" if i == 0 else None, row=1, col=i + 1)
    fig.update_layout(title=title, coloraxis=dict(colorscale="RdBu", cmid=0.0, colorbar=dict(title=value)),
                      height=max(400, 20 * df["layer"].nunique() + 200), width=max(600, 500 * len(groups)))
    return fig


def head_map_figure(df: pd.DataFrame, title: str = "", value: Optional[str] = None) -> go.Figure:
    """``patching_heatmap`` of a layer x head table with a click target on every cell.

    Plotly reports no click on a heatmap cell to Streamlit (streamlit/streamlit#8760), so an
    invisible marker sits on each cell; a click selects it, and its ``customdata`` is [layer, head].
    The markers carry the hover text, so the heatmap's own hover is switched off.

    Example:
        >>> df = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "delta": [0.1, -0.2, 0.3, 0.0]})
        >>> fig = head_map_figure(df, "heads", value="delta")
        >>> fig.data[1].customdata[:2], fig.data[1].marker.opacity
        (([0, 0, 0.1], [0, 1, -0.2]), 0)
    """
    if "head" not in df.columns or ("position" in df.columns and not df["position"].eq(-1).all()):
        raise InputError("head_map_figure draws a layer x head table (patch_heads, or attribution rows of site 'heads')")
    value = value or next(c for c in ("normalized", "attribution", "metric") if c in df.columns)
    cells = df.sort_values(["layer", "head"])
    fig = patching_heatmap(cells[["layer", "head", value]], title, value)
    fig.update_traces(hoverinfo="skip", hovertemplate=None, selector=dict(type="heatmap"))
    fig.add_trace(go.Scatter(
        x=cells["head"], y=cells["layer"], mode="markers", showlegend=False,
        marker=dict(symbol="square", size=14, opacity=0),
        customdata=[[int(l), int(h), float(v)] for l, h, v in zip(cells["layer"], cells["head"], cells[value])],
        hovertemplate="L%{customdata[0]}H%{customdata[1]}<br>" + value + "=%{customdata[2]:.4f}<extra></extra>"))
    # Fixed ranges: the markers must not widen the axes, so cell (layer, head) stays where the heatmap draws it.
    fig.update_xaxes(range=[-0.5, cells["head"].max() + 0.5])
    fig.update_yaxes(range=[cells["layer"].max() + 0.5, -0.5], autorange=False)
    fig.update_layout(clickmode="event+select", hoverdistance=-1)
    return fig

