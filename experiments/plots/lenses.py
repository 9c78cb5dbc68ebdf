"""The tuned lens's figure: KL (or cross-entropy) by layer, one line per lens."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from workbench.errors import InputError


def lens_kl_figure(table: pd.DataFrame, value: str = "kl") -> go.Figure:
    """One line per lens: ``value`` ("kl" or "cross_entropy") by layer.

    Example:
        >>> from experiments.lenses import TunedLens, lens_kl_by_layer
        >>> figure = lens_kl_figure(lens_kl_by_layer(model, tokens, TunedLens.for_model(model)))
        >>> [trace.name for trace in figure.data]
        ['logit lens', 'tuned lens']
    """
    if value not in ("kl", "cross_entropy"):
        raise InputError(f"value must be 'kl' or 'cross_entropy', got {value!r}")
    figure = go.Figure()
    for name, rows in table.groupby("lens", sort=False):
        figure.add_trace(go.Scatter(x=rows.layer, y=rows[value], mode="lines+markers", name=f"{name} lens"))
    title = "KL to the final distribution (nats)" if value == "kl" else "next-token cross-entropy (nats)"
    figure.update_layout(xaxis_title="layer (stream entering the block)", yaxis_title=title, height=360,
                         margin=dict(l=40, r=20, t=30, b=40))
    return figure
