"""Figures of ``experiments.probes``: held-out accuracy and AUROC by hook, with their spread over seeds."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from workbench.errors import InputError


def probe_scores_figure(table: pd.DataFrame, title: str = "Probe held-out scores by hook") -> go.Figure:
    """Accuracy and AUROC per hook (``train_probe``'s table), error bars one standard deviation over seeds.

    >>> table = pd.DataFrame({"hook_name": ["blocks.0.hook_resid_post"], "accuracy": [0.9], "accuracy_std": [0.02],
    ...                       "auroc": [0.95], "auroc_std": [0.01]})
    >>> [trace.name for trace in probe_scores_figure(table).data]
    ['accuracy', 'AUROC']
    """
    missing = {"hook_name", "accuracy", "accuracy_std", "auroc", "auroc_std"} - set(table.columns)
    if missing:
        raise InputError(f"the probe table lacks the columns {sorted(missing)} (pass train_probe(...).table)")
    figure = go.Figure()
    for column, name in (("accuracy", "accuracy"), ("auroc", "AUROC")):
        if table[column].notna().any():
            figure.add_trace(go.Scatter(x=table["hook_name"], y=table[column], name=name, mode="lines+markers",
                                        error_y={"type": "data", "array": table[f"{column}_std"].fillna(0)}))
    figure.update_layout(title=title, xaxis_title="hook", yaxis_title="held-out score", yaxis_range=[0, 1.05])
    return figure
