"""Figures of ``experiments.features``: a feature's activation-density histogram and the prompt's active
features as a token x feature heatmap. (A feature's top windows are drawn by ``experiments.plots.neurons``'s
``top_windows_html``: the same table.)"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from experiments.plots.common import labelled_heatmap


def density_figure(density: pd.DataFrame, title: str = "") -> go.Figure:
    """Bars of a ``feature_density`` table: how many corpus tokens fire the feature in each log10 bin.

    Example:
        >>> density = pd.DataFrame({"log10_low": [-1.0, 0.0], "log10_high": [0.0, 1.0], "count": [3, 1],
        ...                         "fraction": [0.03, 0.01]})
        >>> fig = density_figure(density, "feature 3")
        >>> list(fig.data[0].x), list(fig.data[0].y)
        ([-0.5, 0.5], [3, 1])
    """
    centres = ((density["log10_low"] + density["log10_high"]) / 2).tolist()
    widths = (density["log10_high"] - density["log10_low"]).tolist()
    fig = go.Figure(go.Bar(x=centres, y=density["count"].tolist(), width=widths, marker_color="#2166ac",
                           customdata=np.stack([density["log10_low"], density["log10_high"], density["fraction"]], -1),
                           hovertemplate="log10 activation %{customdata[0]:.1f} .. %{customdata[1]:.1f}<br>"
                                         "%{y} tokens (%{customdata[2]:.3%} of all)<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="log10 of the activation (where positive)", yaxis_title="tokens",
                      bargap=0.05, height=320)
    return fig


def active_features_figure(table: pd.DataFrame, str_tokens: list[str], title: str = "") -> go.Figure:
    """A token x feature heatmap of an ``active_features`` table: the features most active anywhere on the
    prompt as columns (by their peak), each token a row; empty cells are features not in a token's top k.

    Example:
        >>> table = pd.DataFrame({"position": [0, 1, 1], "token": ["a", "b", "b"], "rank": [1, 1, 2],
        ...                       "feature": [7, 2, 7], "activation": [1.0, 3.0, 0.5]})
        >>> fig = active_features_figure(table, ["a", "b"])
        >>> list(fig.data[0].x), fig.data[0].z.tolist()
        (['2', '7'], [[nan, 1.0], [3.0, 0.5]])
    """
    order = table.groupby("feature")["activation"].max().sort_values(ascending=False).index.tolist()
    z = np.full((len(str_tokens), len(order)), np.nan)
    column = {feature: i for i, feature in enumerate(order)}
    for row in table.itertuples():
        z[row.position, column[row.feature]] = row.activation
    labels = [f"{p}: {t!r}"[:30] for p, t in enumerate(str_tokens)]
    fig = labelled_heatmap(z, [str(f) for f in order], labels, title=title, x_title="feature", y_title="token",
                           value_name="activation")
    fig.update_layout(height=max(300, 22 * len(str_tokens) + 140))
    return fig
