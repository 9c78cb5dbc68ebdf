"""Figures of ``experiments.ablation``: the per-head map of a head sweep."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import torch

from experiments.plots.common import scores_heatmap


def head_sweep_heatmap(table: pd.DataFrame, title: str = "Loss change when zero-ablating each head",
                       value: str = "delta", value_name: str = "delta loss") -> go.Figure:
    """Layer x head heatmap of a ``head_sweep`` table (rows layer-major, as ``head_sweep`` returns them),
    diverging around 0.

    Example:
        >>> from experiments.ablation import head_sweep
        >>> table = head_sweep(model, tokens, progress=False)
        >>> head_sweep_heatmap(table).data[0].z.shape                   # toy-attn-2l: 2 layers of 4 heads
        (2, 4)
    """
    grid_LH = torch.tensor(table[value].values).view(table["layer"].nunique(), table["head"].nunique())
    return scores_heatmap(grid_LH, title, colorscale="RdBu_r", zmid=0.0, value_name=value_name)
