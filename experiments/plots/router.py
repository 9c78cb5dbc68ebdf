"""Figures of ``experiments.router``: expert load and the shared expert's share of the MLP output, as heatmaps."""

from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd
import plotly.graph_objects as go

from experiments._tokens import axis_labels
from experiments.figures import labelled_heatmap


def expert_load_figure(df: pd.DataFrame) -> go.Figure:
    """MoE layer x expert heatmap of the load fraction (gaps where a layer has fewer experts).

    Example:
        >>> expert_load_figure(expert_load(moe_model, tokens))   # doctest: +SKIP
    """
    grid = df.pivot(index="layer", columns="expert", values="fraction")
    fig = labelled_heatmap(grid.values, [str(e) for e in grid.columns], [str(l) for l in grid.index],
                           title="Expert load (share of routed token slots)", x_title="expert", y_title="layer",
                           value_name="fraction", colorscale="Viridis")
    return fig


def shared_vs_routed_figure(df: pd.DataFrame, tokens: Optional[Sequence[str]] = None) -> go.Figure:
    """Layer x position heatmap of the shared expert's share of the MLP output (``shared_vs_routed``'s table).

    ``tokens``: each position's text, for the x labels (positions alone without it).

    Example:
        >>> shared_vs_routed_figure(shared_vs_routed(moe_model, tokens), moe_model.to_str_tokens(tokens))   # doctest: +SKIP
    """
    grid = df.pivot(index="layer", columns="position", values="shared_fraction")
    x_labels = axis_labels(list(tokens)) if tokens is not None else [str(p) for p in grid.columns]
    return labelled_heatmap(grid.values, x_labels, [str(l) for l in grid.index],
                            title="Shared expert's share of the MLP output: |shared| / (|routed| + |shared|)",
                            x_title="position", y_title="layer", value_name="shared fraction", colorscale="Viridis")
