"""The shared plotly helpers' old address: they live in ``experiments.plots.common``.

Kept so that modules not yet moved to ``experiments.plots`` (issue 32) still import them from here;
delete once nothing imports ``experiments.figures``.
"""

from experiments.plots.common import distinct_labels, labelled_heatmap, scores_heatmap, signed_token_bars, to_numpy

__all__ = ["distinct_labels", "labelled_heatmap", "scores_heatmap", "signed_token_bars", "to_numpy"]
