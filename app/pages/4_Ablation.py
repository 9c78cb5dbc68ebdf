"""Ablation: knock out heads, layers, neurons or experts (zero, mean or resample) and see how the
loss on each token and the top next-token predictions change; sweep every head as a heatmap.

The sweep scores the prediction at the last token by default (the answer's probability, or its logit difference
with the runner-up; the answer is the clean model's top prediction unless one is typed): a head that moves
P(" Paris") from 0.435 to 0.166 barely moves the loss averaged over the whole prompt, which is one choice among them.

Legend: H n_heads, L n_layers.
"""

from __future__ import annotations

import html
from typing import Optional

import pandas as pd
import streamlit as st
import torch

from app import downloads, results
from app.ablation_picker import choose_method, choose_targets, reference_rows
from app.results.ablation import last_token_predictions
from app.safe_text import quoted
from app.state import LoadedModel
from app.url_state import linked
from app.widgets import Prompt, page_setup, progress_callback, prompt_box, require_model, run_page, single_token

SWEEP_METRICS = {"probability": "Answer's probability at the last token",
                 "logit_diff": "Logit difference at the last token (answer - runner-up)",
                 "loss": "Loss over the whole prompt"}
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


def _sweep_metric(loaded: LoadedModel, prompt: Prompt, clean_top: Optional[pd.DataFrame]) -> tuple[tuple, str, str]:
    """What the sweep scores (a ``SweepMetric``), its name for the heatmap and its unit. ``clean_top``: the
    ablation's top-predictions table, whose clean columns give the default answer and runner-up without another
    forward (None when nothing is ablated)."""
    left, right = st.columns(2)
    with left:
        choice = linked(st.radio, "Sweep metric", options=list(SWEEP_METRICS), format_func=SWEEP_METRICS.get,
                        key="ablation_sweep_metric")
    if choice == "loss":
        return ("loss",), "loss", "loss change"
    with right:
        typed = linked(st.text_input, "Answer token (blank: the clean model's top prediction)", value="",
                       key="ablation_answer")
    top = ([int(token) for token in clean_top["clean_token_id"][:2]] if clean_top is not None else
           [token for token, _ in last_token_predictions(loaded, prompt.ids, 2)])
    answer = single_token(loaded.model, typed, "answer") if typed else top[0]
    wrong = next(token for token in top if token != answer)
    answer_text, wrong_text = (loaded.model.to_string([token]) for token in (answer, wrong))
    if choice == "probability":
        st.caption(f"Scores P({quoted(repr(answer_text))}) after the last token.")
        return ("probability", answer), f"P({answer_text!r})", "probability change"
    st.caption(f"Scores logit({quoted(repr(answer_text))}) - logit({quoted(repr(wrong_text))}) after the last token.")
    return ("logit_diff", answer, wrong), f"logit({answer_text!r}) - logit({wrong_text!r})", "logit difference change"


def main() -> None:
    st.title("Ablation")
    loaded = require_model()
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    targets = choose_targets(loaded)
    method = choose_method(targets)
    reference = reference_rows(loaded, prompt, method)
    top = None  # the clean top predictions, when an ablation ran: the sweep's default answer comes from them
    if not targets:
        st.info("Choose at least one thing to ablate.")
    else:
        per_token, top = results.ablation_effects(loaded, prompt.ids, targets, method, reference)
        _effects_view(per_token, top)

    st.subheader("Every head, one at a time")
    cfg = loaded.model.cfg
    metric, metric_name, unit = _sweep_metric(loaded, prompt, top)
    args = (prompt.ids, method, reference)
    if st.button(f"Run the head sweep ({cfg.n_layers * cfg.n_heads} heads, {method} ablation)", key="ablation_sweep") \
            or results.has_head_sweep(loaded, *args, metric=metric):
        sweep = results.head_sweep(loaded, *args, bar=progress_callback, metric=metric)
        delta_LH = torch.tensor(sweep["delta"].values).view(cfg.n_layers, cfg.n_heads)
        # Loss rises when a head matters; the answer's probability and logit difference fall: red is "it mattered".
        fig = scores_heatmap(delta_LH, html.escape(f"Change in {metric_name} when {method}-ablating each head",
                                                   quote=False),
                             colorscale="RdBu_r" if metric == ("loss",) else "RdBu", zmid=0.0, value_name=unit)
        downloads.figure(fig, f"head_sweep_{method}", key="head_sweep", stretch=False)
        downloads.table(sweep, f"head_sweep_{method}", key="head_sweep_table", height=250)


page_setup("Ablation")
run_page(main)
