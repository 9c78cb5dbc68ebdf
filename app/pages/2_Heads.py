"""Heads: compare every head across layers by each score, in heatmaps and a sortable table,
and put two chosen heads' patterns side by side on the same prompt.

Legend: P position, S key position, H n_heads, L n_layers.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st
import torch

from app import downloads, results
from app.state import LoadedModel
from app.url_state import linked
from app.widgets import Prompt, guarded, head_picker, page_setup, progress_callback, prompt_box, require_model, run_page
from experiments.plots.attention import pattern_figure
from experiments.plots.common import scores_heatmap

# column -> (tab title, colour scale, centre of the scale); signed scores get a diverging scale.
SCORES = {
    "induction": ("Induction", "Blues", None),
    "previous_token": ("Previous token", "Blues", None),
    "duplicate_token": ("Duplicate token", "Blues", None),
    "entropy": ("Entropy (nats)", "Viridis", None),
    "ablation_delta": ("Ablation effect (loss change)", "RdBu_r", 0.0),
}
SCORE_TAB_KEY = "heads_score_tab"  # the open tab's title


def _heatmaps(table, n_layers: int, n_heads: int) -> None:
    # Only the open tab's heatmap is built and sent (choosing another tab reruns the page, its scores cached): the
    # browser drew all five plotly figures on every prompt change and every visit, four of them unseen.
    tabs = st.tabs([title for title, _, _ in SCORES.values()], key=SCORE_TAB_KEY, on_change="rerun")
    for tab, (column, (title, colorscale, zmid)) in zip(tabs, SCORES.items()):
        if not tab.open:
            continue
        with tab:
            if table[column].isna().all():
                st.info("Not computed: tick “Include the ablation effect” above to run the head sweep.")
                continue
            grid_LH = table.pivot(index="layer", columns="head", values=column).reindex(
                index=range(n_layers), columns=range(n_heads)).values
            fig = scores_heatmap(torch.tensor(grid_LH), title, colorscale=colorscale, zmid=zmid, value_name=column)
            downloads.figure(fig, f"heads_{column}", key=f"heads_{column}", stretch=False)


@st.fragment
@guarded
def _side_by_side(loaded: LoadedModel, prompt: Prompt, table: pd.DataFrame) -> None:
    st.subheader("Two heads side by side")
    st.caption("They start as this prompt's strongest previous-token head and strongest induction head.")
    patterns_LHPS = results.attention_patterns(loaded, prompt.ids)
    defaults = [tuple(int(v) for v in table.loc[table[score].fillna(float("-inf")).idxmax(), ["layer", "head"]])
                for score in ("previous_token", "induction")]
    left, right = st.columns(2)
    for column, label, key, default in ((left, "Left", "heads_left", defaults[0]),
                                        (right, "Right", "heads_right", defaults[1])):
        with column:
            layer, head = head_picker(loaded, label, key=key, default=default)
            fig = pattern_figure(patterns_LHPS[layer, head], prompt.str_tokens, f"L{layer}H{head}")
            downloads.figure(fig, f"pattern_L{layer}H{head}", key=f"{key}_pattern")


def main() -> None:
    st.title("Compare heads across layers")
    loaded = require_model()
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    cfg = loaded.model.cfg
    include_ablation = linked(
        st.checkbox, "Include the ablation effect (zero-ablates every head in turn)", value=cfg.n_layers * cfg.n_heads <= 64,
        key="heads_include_ablation",
        help=f"{cfg.n_layers * cfg.n_heads} heads; each is ablated once on this prompt (batched).")
    table = results.head_scores(loaded, prompt.ids, include_ablation, bar=progress_callback)
    st.caption("Scores on this prompt: induction, previous-token and duplicate-token are TransformerLens's "
               "“mul” detector scores; entropy is the mean entropy of each query's attention; the ablation effect "
               "is the change in mean next-token loss when the head is zero-ablated.")
    _heatmaps(table, cfg.n_layers, cfg.n_heads)

    st.subheader("Every head, every score")
    st.caption("Click a column header to sort.")
    downloads.table(table, "head_scores", key="head_scores", height=320)

    _side_by_side(loaded, prompt, table)


page_setup("Heads")
run_page(main)
