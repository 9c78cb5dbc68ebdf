"""Figures (plotly) and HTML of the experiments: each module draws what its namesake in ``experiments`` computes.

One module per experiment: ``ablation``, ``attention``, ``attribution``, ``circuits``, ``continuations``,
``features``, ``flow``, ``induction``, ``ioi``, ``lens``, ``lenses``, ``neurons``, ``patching``, ``probes``, ``router``,
``steering``, ``token_view`` and ``zoo``; ``common`` holds the helpers they share with the dashboard (heatmaps, signed token bars, arrays), ``raster``
value grids coloured into PNG images (the dashboard's attention grid).
"""
