"""Figures of the induction experiments (``experiments.induction``); the score heatmap is ``experiments.plots.common.scores_heatmap``."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go


def induction_loss_figure(loss_df: pd.DataFrame) -> go.Figure:
    """Per-position loss of the first and second copy as two lines.

    Example:
        >>> from experiments.induction import induction_loss
        >>> fig = induction_loss_figure(induction_loss(model, seq_len=20, batch=4))
        >>> [trace.name for trace in fig.data], len(fig.data[0].x)
        (['first', 'second'], 20)
    """
    import plotly.express as px  # imported here: it is slow to import and only this figure needs it

    fig = px.line(loss_df, x="position", y="loss", color="copy", title="Loss on repeated random tokens")
    return fig
