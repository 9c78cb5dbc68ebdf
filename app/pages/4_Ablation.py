"""Ablation: knock out heads, layers, neurons or experts (zero, mean or resample) and see how the
loss on each token and the top next-token predictions change; sweep every head as a heatmap.

Legend: H n_heads, L n_layers.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st
import torch

from app import downloads, results
from app.ablation_picker import choose_method, choose_targets, reference_rows
from app.widgets import page_setup, progress_callback, prompt_box, require_model, run_page
from experiments.plots.common import scores_heatmap, signed_token_bars


def _effects_view(per_token: pd.DataFrame, top: pd.DataFrame) -> None:
    cols = st.columns(3)
    clean, ablated = per_token["clean_loss"].mean(), per_token["ablated_loss"].mean()
    cols[0].metric("Mean loss, clean", f"{clean:.4f}")
    cols[1].metric("Mean loss, ablated", f"{ablated:.4f}", delta=f"{ablated - clean:+.4f}", delta_color="inverse")
    fig = signed_token_bars(per_token, "delta", "Change in loss of predicting each token (ablated - clean)",
                            value_name="loss change", x_title="predicted token", hover=["clean_loss", "ablated_loss"])
    downloads.figure(fig, "ablation_per_token", key="ablation_per_token")
    downloads.table(per_token, "ablation_per_token", key="ablation_per_token_table", height=220)
    st.markdown("**Top next-token predictions after the last token, clean and ablated**")
    downloads.table(top, "ablation_top_predictions", key="ablation_top")


def main() -> None:
    st.title("Ablation")
    loaded = require_model()
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    targets = choose_targets(loaded)
    method = choose_method(targets)
    reference = reference_rows(loaded, prompt, method)
    if not targets:
        st.info("Choose at least one thing to ablate.")
    else:
        _effects_view(*results.ablation_effects(loaded, prompt.ids, targets, method, reference))

    st.subheader("Every head, one at a time")
    cfg = loaded.model.cfg
    args = (prompt.ids, method, reference)
    if st.button(f"Run the head sweep ({cfg.n_layers * cfg.n_heads} heads, {method} ablation)", key="ablation_sweep") \
            or results.has_head_sweep(loaded, *args):
        sweep = results.head_sweep(loaded, *args, bar=progress_callback)
        delta_LH = torch.tensor(sweep["delta"].values).view(cfg.n_layers, cfg.n_heads)
        fig = scores_heatmap(delta_LH, f"Loss change when {method}-ablating each head", colorscale="RdBu_r",
                             zmid=0.0, value_name="loss change")
        downloads.figure(fig, f"head_sweep_{method}", key="head_sweep", stretch=False)
        downloads.table(sweep, f"head_sweep_{method}", key="head_sweep_table", height=250)


page_setup("Ablation")
run_page(main)
