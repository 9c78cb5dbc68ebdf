"""Attention: every head's pattern for one layer, a layer x head grid of patterns, per-head statistics, and
every head's attention to one chosen token.

Special tokens (BOS, pad) are left out of the colour scales unless the toggle brings them back: BOS is an
attention sink, and a 0-1 scale shows most heads past the first layers as blank. The grid's layer range follows
a new prompt (the layers where the last token reads content, ``app.attention_views``).

The layer view and the grid are fragments: moving the layer slider redraws only its own
figures, not the grid (the largest payload on the page) or the table.

Legend: P position, S key position, H n_heads, L n_layers.
"""

from __future__ import annotations

import streamlit as st

from app.serve import preload_plotly_while_warming

preload_plotly_while_warming()  # before the imports below: on a cold start they wait for the server's warm-up

import torch  # noqa: E402

from app import downloads, results
from app.attention_views import default_grid_layers, who_attends_view
from app.safe_text import quoted
from app.special_tokens import scale_max, show_special_toggle, special_positions
from app.state import LoadedModel
from app.url_state import follow, linked
from app.widgets import Prompt, guarded, layer_picker, page_setup, prompt_box, require_model, run_page
from experiments.plots import attention as attention_plots

# The grid sends every pattern value to the browser; past this many cells it draws fewer
# layers by default (the user can widen the range) so the page stays quick. At 250,000 cells a
# 64-token prompt change took 2.4 s in Chromium, at 150,000 1.8 s (BENCHMARKS.md, section 6).
# Since then the figure's bytes matter less: at 75,000 cells (2 layers at 64 tokens instead of 4) Chromium's CPU
# per prompt change fell only from 0.79 to 0.76 s (interleaved, medians of 9), so the budget stays. The grid now
# travels as one PNG (``light=True``): the 64-token prompt change went from 0.55 to 0.50 s in Chromium.
GRID_CELL_BUDGET = 150_000


@st.fragment
@guarded
def _layer_view(loaded: LoadedModel, prompt: Prompt, patterns_LHPS: torch.Tensor, special: tuple[int, ...]) -> None:
    st.subheader("One layer, every head")
    layer = layer_picker(loaded, key="attention_layer")
    fig = attention_plots.layer_patterns_figure(patterns_LHPS[layer], prompt.str_tokens, layer, key_labels=True)
    top = scale_max(patterns_LHPS[layer], special, axes=(1, 2))
    fig.update_layout(coloraxis=dict(cmin=0, cmax=top))
    _scale_caption(top, special, prompt)
    downloads.figure(fig, f"attention_layer{layer}", key="layer_patterns")

    # Drawn on request: each plotly figure costs the browser 0.15-0.25 s, and the prompt-change re-render
    # at 64 tokens has a 0.5 s goal (BENCHMARKS.md, section 6). Chromium's CPU per 64-token prompt change on this
    # page, each view left out in turn (issue 52, load 6-8): this layer figure 0.26 s, the grid 0.21 s, the table
    # 0.07 s, who-attends 0.03 s, the rest of the page 0.15 s; the server's 0.25 s is mostly the forward pass.
    # Since the layer figure is one tiled heatmap, not a subplot per head, the browser's CPU (its threads' CPU time in
    # a Chromium trace, 4 changes, load 4-6) fell from 0.73 to 0.66 s a change; left out in turn then: the grid
    # 0.18 s, who-attends 0.07 s, the table under 0.02 s.
    head = linked(st.selectbox, "Look closer at one head of this layer", options=[None, *range(loaded.model.cfg.n_heads)],
                  format_func=lambda h: "choose a head" if h is None else f"L{layer}H{h}", key="attention_focus_head")
    if head is not None:
        focus = attention_plots.pattern_figure(patterns_LHPS[layer, head], prompt.str_tokens, f"L{layer}H{head}")
        focus.update_traces(zmin=0, zmax=scale_max(patterns_LHPS[layer, head], special, axes=(0, 1)))
        downloads.figure(focus, f"attention_L{layer}H{head}", key="focus_pattern", stretch=False)


def _scale_caption(top: float, special: tuple[int, ...], prompt: Prompt) -> None:
    left_out = ", ".join(f"{p} {quoted(repr(prompt.str_tokens[p]))}" for p in special)
    st.caption(f"Colour scale 0 to {top:.3f}" + (f" (special tokens left out: {left_out})." if special else "."))


def _default_grid_layers(patterns_LHPS: torch.Tensor, special: tuple[int, ...]) -> tuple[int, int]:
    """All layers when they fit the budget, else as many consecutive layers as do (at least one): those where the
    last token reads the most content (``app.attention_views.default_grid_layers``)."""
    n_layers, n_heads, n_queries, n_keys = patterns_LHPS.shape
    fits = max(1, GRID_CELL_BUDGET // max(n_heads * n_queries * n_keys, 1))
    return default_grid_layers(patterns_LHPS, special, fits)


@st.fragment
@guarded
def _grid(loaded: LoadedModel, prompt: Prompt, patterns_LHPS: torch.Tensor, special: tuple[int, ...]) -> None:
    st.subheader("Layer x head grid")
    n_layers = patterns_LHPS.shape[0]
    first, last = 0, 0
    if n_layers > 1:
        default = _default_grid_layers(patterns_LHPS, special)
        first, last = linked(st.slider, "Layers in the grid", min_value=0, max_value=n_layers - 1, value=default,
                             key="attention_grid_layers",
                                help="Each tile is one head's pattern (queries down, keys across).")
    top = scale_max(patterns_LHPS[first:last + 1], special, axes=(2, 3))
    # light: the tiles as one PNG coloured on the server and a hover per tile, a tenth of the values' bytes.
    fig = attention_plots.pattern_grid_figure(patterns_LHPS, prompt.str_tokens, layers=range(first, last + 1),
                                              light=True, zmax=top)
    _scale_caption(top, special, prompt)
    downloads.figure(fig, f"attention_grid_L{first}-{last}", key="pattern_grid")


def main() -> None:
    st.title("Attention patterns")
    loaded = require_model()
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    patterns_LHPS = results.attention_patterns(loaded, prompt.ids)
    include = show_special_toggle("the colour scales and the default layers and key")
    special = () if include else special_positions(loaded.model, prompt.ids)
    # A range chosen for another prompt (or with the special tokens the other way) gives way to this one's default.
    follow("attention_grid", (prompt.ids, include), "attention_grid_layers")
    _layer_view(loaded, prompt, patterns_LHPS, special)

    st.subheader("Per-head summary")
    st.caption("entropy in nats; bos_attention: mean attention to position 0; prev_token_share: mean attention "
               "to the previous token; mean_distance: how far back a head looks on average.")
    summary = results.head_summary(loaded, prompt.ids)
    downloads.table(summary, "attention_head_summary", key="head_summary", height=300)

    who_attends_view(patterns_LHPS, prompt.str_tokens, prompt.ids, special)
    _grid(loaded, prompt, patterns_LHPS, special)


page_setup("Attention")
run_page(main)
