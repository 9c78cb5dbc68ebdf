"""Figures of the IOI experiment (``experiments.ioi``); its head patching map is ``experiments.patching``'s heatmap."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go


def logit_diff_figure(logit_diff: pd.DataFrame) -> go.Figure:
    """Histogram of the clean and corrupted logit differences over the prompts.

    Example:
        >>> fig = logit_diff_figure(pd.DataFrame({"prompt": [0, 1], "clean": [2.5, 1.0], "corrupt": [-1.0, 0.5]}))
        >>> [(trace.name, trace.x.tolist()) for trace in fig.data]
        [('clean', [2.5, 1.0]), ('corrupt', [-1.0, 0.5])]
    """
    fig = go.Figure([go.Histogram(x=logit_diff[column], name=column, opacity=0.7) for column in ("clean", "corrupt")])
    fig.update_layout(barmode="overlay", title="IOI logit difference logit[IO] - logit[S] per prompt",
                      xaxis_title="logit difference", yaxis_title="prompts")
    return fig
