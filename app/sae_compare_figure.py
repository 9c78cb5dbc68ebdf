"""The SAE comparison page's frontier: each SAE's L0 against its explained variance or loss recovered, with error
bars of one standard deviation over seeds in both directions (up and to the left is better)."""

from __future__ import annotations

import html

import pandas as pd
import plotly.graph_objects as go


def frontier_figure(points: pd.DataFrame, y_label: str) -> go.Figure:
    """A scatter of ``points`` (``app.results.sae_compare.frontier_points``: ``sae``, ``l0``, ``l0_std``, ``y``,
    ``y_std``), one labelled marker per SAE with its spreads as error bars; ``y_label`` names the y measure.

    Example:
        >>> points = pd.DataFrame({"sae": ["a"], "l0": [16.0], "l0_std": [0.0], "y": [0.75], "y_std": [0.01]})
        >>> figure = frontier_figure(points, "Explained variance")
        >>> figure.data[0].name, list(figure.data[0].error_y.array), figure.layout.xaxis.title.text
        ('a', [0.01], 'L0 (active features per token)')
        >>> frontier_figure(points.assign(sae=['<a href="x">b</a>']), "Explained variance").data[0].name
        '&lt;a href=&quot;x&quot;&gt;b&lt;/a&gt;'
    """
    figure = go.Figure()
    for row in points.itertuples(index=False):
        label = html.escape(str(row.sae))  # plotly draws some HTML in labels: a folder's name must not
        figure.add_scatter(x=[row.l0], y=[row.y], mode="markers+text", name=label, text=[label],
                           textposition="top center", customdata=[label],
                           error_x={"type": "data", "array": [row.l0_std], "visible": True},
                           error_y={"type": "data", "array": [row.y_std], "visible": True},
                           hovertemplate=f"%{{customdata}}<br>L0 %{{x:.4g}} ± {row.l0_std:.3g}<br>{y_label} "
                                         f"%{{y:.4g}} ± {row.y_std:.3g}<extra></extra>",
                           marker={"size": 12})
    figure.update_layout(title=f"L0 against {y_label.lower()} (mean over seeds, bars: one standard deviation)",
                         xaxis_title="L0 (active features per token)", yaxis_title=y_label, height=450,
                         legend_title_text="SAE")
    return figure
