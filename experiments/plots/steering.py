"""The coefficient sweep as a plotly figure: the measure against the multiplier, one line per prompt and their
mean."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from workbench.errors import InputError


def sweep_figure(table: pd.DataFrame, measure_label: str = "score", title: str = "Coefficient sweep") -> go.Figure:
    """``coefficient_sweep``'s table drawn: each prompt's score (thin lines) and the mean (thick) by coefficient
    (plain lists, so the browser's figure holds the numbers themselves).

    Example:
        >>> table = pd.DataFrame({"coefficient": [0.0, 1.0, 0.0, 1.0], "prompt": [0, 0, 1, 1], "score": [1, 2, 3, 5]})
        >>> fig = sweep_figure(table, "logit difference")
        >>> [trace.name for trace in fig.data], list(fig.data[-1].y)
        (['prompt 0', 'prompt 1', 'mean'], [2.0, 3.5])
    """
    missing = {"coefficient", "prompt", "score"} - set(table.columns)
    if missing:
        raise InputError(f"the sweep table lacks columns {sorted(missing)}")
    fig = go.Figure()
    for prompt, rows in table.groupby("prompt", sort=True):
        rows = rows.sort_values("coefficient")
        fig.add_trace(go.Scatter(x=rows.coefficient.tolist(), y=rows.score.astype(float).tolist(),
                                 mode="lines+markers", name=f"prompt {prompt}", line=dict(width=1), opacity=0.5))
    mean = table.groupby("coefficient", sort=True).score.mean()
    fig.add_trace(go.Scatter(x=mean.index.tolist(), y=mean.astype(float).tolist(), mode="lines+markers", name="mean",
                             line=dict(width=3)))
    fig.update_layout(title=title, xaxis_title="coefficient (multiplier)", yaxis_title=measure_label,
                      height=380, margin=dict(l=40, r=20, t=50, b=40))
    return fig
