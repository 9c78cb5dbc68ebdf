"""Figures (plotly) and HTML of the experiments: each module draws what its namesake in ``experiments`` computes."""
