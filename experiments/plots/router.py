"""Figures of ``experiments.router``: expert load and the shared expert's share of the MLP output, as heatmaps."""

from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd
import plotly.graph_objects as go

from experiments._tokens import axis_labels
from experiments.plots.common import labelled_heatmap


def expert_load_figure(df: pd.DataFrame) -> go.Figure:
    """MoE layer x expert heatmap of the load fraction (gaps where a layer has fewer experts).

    Example:
        >>> from experiments.router import expert_load
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)
        >>> expert_load_figure(expert_load(moe_model, "The cat sat on the mat")).data[0].z.shape   # layer x expert
        (2, 4)
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
        >>> from experiments.router import shared_vs_routed
        >>> shared_model = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=model.cfg.d_vocab,
        ...     n_ctx=32, d_mlp=16, num_experts=4, experts_per_token=2, moe=wb.MoEConfig(d_shared_expert=24)),
        ...     tokenizer=model.tokenizer)
        >>> toks = shared_model.to_tokens("Hello world")
        >>> fig = shared_vs_routed_figure(shared_vs_routed(shared_model, toks), shared_model.to_str_tokens(toks))
        >>> fig.data[0].z.shape   # layer x position
        (2, 7)
    """
    grid = df.pivot(index="layer", columns="position", values="shared_fraction")
    x_labels = axis_labels(list(tokens)) if tokens is not None else [str(p) for p in grid.columns]
    return labelled_heatmap(grid.values, x_labels, [str(l) for l in grid.index],
                            title="Shared expert's share of the MLP output: |shared| / (|routed| + |shared|)",
                            x_title="position", y_title="layer", value_name="shared fraction", colorscale="Viridis")
