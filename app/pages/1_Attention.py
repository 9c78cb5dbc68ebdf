"""Attention: every head's pattern for one layer, a layer x head grid of patterns, per-head statistics.

The layer view and the grid are fragments: moving the layer slider redraws only its own
figures, not the grid (the largest payload on the page) or the table.
"""

from __future__ import annotations

import numpy as np
import streamlit as st
import torch

from app import downloads, results
from app.state import LoadedModel, require_model
from app.widgets import Prompt, layer_picker, guarded, page_setup, prompt_box, run_page
from experiments import attention

# The grid sends every pattern value to the browser; past this many cells it draws fewer
# layers by default (the user can widen the range) so the page stays quick. At 250,000 cells a
# 64-token prompt change took 2.4 s in Chromium, at 150,000 1.8 s (BENCHMARKS.md, section 6).
GRID_CELL_BUDGET = 150_000


KEY_LABEL_PX = 75  # room under each row of subplots for the rotated key labels


def _show_key_labels(fig) -> None:
    """Turns on the key (x) token labels of every subplot, lifting each row's bottom edge to make room.

    The figure arrives with only query labels; shown as they are, the key labels would run
    into the titles of the row below.
    """
    y_axes = [name for name in fig.layout if name.startswith("yaxis")]
    n_rows = len({tuple(fig.layout[name].domain) for name in y_axes})
    height = (fig.layout.height or 600) + KEY_LABEL_PX * n_rows
    for name in y_axes:
        bottom, top = fig.layout[name].domain
        fig.layout[name].domain = (min(bottom + KEY_LABEL_PX / height, top - 0.01), top)
    fig.update_xaxes(showticklabels=True, tickangle=-90, tickfont=dict(size=9))
    fig.update_layout(height=height)


@st.fragment
@guarded
def _layer_view(loaded: LoadedModel, prompt: Prompt, patterns_LHQK: torch.Tensor) -> None:
    st.subheader("One layer, every head")
    layer = layer_picker(loaded, key="attention_layer")
    fig = attention.layer_patterns_figure(patterns_LHQK[layer], prompt.str_tokens, layer)
    if len(prompt.str_tokens) <= 40:
        _show_key_labels(fig)
    downloads.figure(fig, f"attention_layer{layer}", key="layer_patterns")

    head = st.selectbox("Look closer at one head of this layer", range(loaded.model.cfg.n_heads),
                        format_func=lambda h: f"L{layer}H{h}", key="attention_focus_head")
    focus = attention.pattern_figure(patterns_LHQK[layer, head], prompt.str_tokens, f"L{layer}H{head}")
    downloads.figure(focus, f"attention_L{layer}H{head}", key="focus_pattern", stretch=False)


def _default_grid_layers(n_layers: int, cells_per_layer: int) -> tuple[int, int]:
    """All layers when they fit the budget, else as many leading layers as do (at least one)."""
    fits = max(1, GRID_CELL_BUDGET // max(cells_per_layer, 1))
    return 0, min(n_layers, fits) - 1


def _lighten(fig) -> None:
    """Moves the grid's hover labels from per-cell data onto the axes, and sends values as float32.

    The figure names each cell's (layer, head, query, key) in a float64 ``customdata`` array:
    15 MB for six SmolLM2 layers at 64 tokens, which the browser took seconds to receive. Here
    every column gets a category label "H3 k12" and every row "L5 q7" (read off that same
    customdata, so the tiling is not re-derived), and the hover shows those labels: the values
    alone travel, at 4 bytes a cell.
    """
    trace = fig.data[0]
    custom = np.asarray(trace.customdata, dtype=np.float64)  # [rows, cols, (layer, head, query, key)], NaN in gaps
    heads_keys, layers_queries = custom[0, :, [1, 3]].T, custom[:, 0, [0, 2]]  # row 0 and column 0 lie in tiles
    x = [f"H{h:.0f} k{k:.0f}" if not np.isnan(h) else f"gap {c}" for c, (h, k) in enumerate(heads_keys)]
    y = [f"L{l:.0f} q{q:.0f}" if not np.isnan(l) else f"gap {r}" for r, (l, q) in enumerate(layers_queries)]
    trace.update(x=x, y=y, z=np.asarray(trace.z, dtype=np.float32), customdata=None,
                 hovertemplate="%{y}<br>%{x}<br>attention=%{z:.3f}<extra></extra>")
    # The tick positions were numeric column/row positions; on category axes they name categories.
    for axis, labels in ((fig.layout.xaxis, x), (fig.layout.yaxis, y)):
        axis.update(type="category", tickvals=[labels[int(v)] for v in axis.tickvals])


@st.fragment
@guarded
def _grid(loaded: LoadedModel, prompt: Prompt, patterns_LHQK: torch.Tensor) -> None:
    st.subheader("Layer x head grid")
    n_layers, n_heads, q, k = patterns_LHQK.shape
    first, last = 0, 0
    if n_layers > 1:
        first, last = st.slider("Layers in the grid", 0, n_layers - 1, _default_grid_layers(n_layers, n_heads * q * k),
                                key="attention_grid_layers",
                                help="Each tile is one head's pattern (queries down, keys across).")
    fig = attention.pattern_grid_figure(patterns_LHQK, prompt.str_tokens, layers=range(first, last + 1))
    _lighten(fig)
    downloads.figure(fig, f"attention_grid_L{first}-{last}", key="pattern_grid")


def main() -> None:
    st.title("Attention patterns")
    loaded = require_model()
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    patterns_LHQK = results.attention_patterns(loaded, loaded.key, prompt.ids)
    _layer_view(loaded, prompt, patterns_LHQK)

    st.subheader("Per-head summary")
    st.caption("entropy in nats; bos_attention: mean attention to position 0; prev_token_share: mean attention "
               "to the previous token; mean_distance: how far back a head looks on average.")
    summary = attention.head_summary(patterns_LHQK, prompt.tensor[0])
    downloads.table(summary, "attention_head_summary", key="head_summary", height=300)

    _grid(loaded, prompt, patterns_LHQK)


page_setup("Attention")
run_page(main)
