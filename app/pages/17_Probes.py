"""Probes: does a layer's residual stream tell two kinds of text apart (held-out accuracy and AUROC by layer),
and a chosen layer's probe watching a generation token by token.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go
import streamlit as st

from app import downloads
from app.results import probes as probe_results
from app.url_state import linked
from app.widgets import page_setup, require_model, run_page
from experiments.plots.probes import probe_scores_figure

FIRST = "\n".join(["I loved this film, it was wonderful.", "What a delightful, happy day.",
                   "The food was excellent and the staff were kind.", "This is the best book I have read.",
                   "Everyone at the party had a great time.", "The concert was beautiful and moving.",
                   "I am so grateful for my friends.", "Our holiday was relaxing and fun."])
SECOND = "\n".join(["I hated this film, it was awful.", "What a miserable, gloomy day.",
                    "The food was terrible and the staff were rude.", "This is the worst book I have read.",
                    "Everyone at the party was bored and annoyed.", "The concert was dull and far too loud.",
                    "I am so tired of my noisy neighbours.", "Our holiday was stressful and expensive."])


def _examples(label: str, default: str, key: str) -> tuple[str, ...]:
    text = linked(st.text_area, label, value=default, height=200, key=key)
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def main() -> None:
    st.title("Probes")
    loaded = require_model()
    st.caption("One example per line. A probe per layer (the residual stream after it, read at each example's last "
               "token) is fitted on three quarters of the examples and scored on the rest, over three splits.")
    left, right = st.columns(2)
    with left:
        first = _examples("Class A (label 0)", FIRST, "probe_first")
    with right:
        second = _examples("Class B (label 1)", SECOND, "probe_second")
    kind = linked(st.radio, "Probe", options=["logistic", "mass_mean"], index=0, horizontal=True, key="probe_kind",
                  format_func=lambda k: {"logistic": "logistic regression", "mass_mean": "mass mean (whitened)"}[k])
    if min(len(first), len(second)) < 4:
        st.warning("Give at least four examples of each class, so each split holds some of both out.")
        return
    table = probe_results.probe_table(loaded, first, second, kind)
    downloads.figure(probe_scores_figure(table, "Held-out accuracy and AUROC by layer"), "probe_scores",
                     key="probe_scores")
    downloads.table(table, "probe_scores", key="probe_table", height=250)

    st.subheader("A probe as a monitor")
    hooks = list(table["hook_name"])
    best = int(table["accuracy"].to_numpy().argmax())
    hook = linked(st.selectbox, "Layer", options=hooks, index=best, key="probe_monitor_hook")
    prompt = linked(st.text_input, "Prompt", value="The film last night was", key="probe_monitor_prompt")
    n_new = linked(st.slider, "New tokens", min_value=1, max_value=probe_results.MONITOR_MAX_NEW_TOKENS, value=16,
                   key="probe_monitor_tokens")
    if not prompt.strip():
        st.info("Type a prompt to generate from.")
        return
    rows = probe_results.monitored_generation(loaded, first, second, kind, hook, prompt, n_new)
    # Plotly reads HTML tags in tick labels: the tokens of a typed (or linked) prompt go in escaped.
    figure = go.Figure(go.Bar(x=[html.escape(f"{p}: {t!r}", quote=False) for p, t in zip(rows["position"], rows["token"])], y=rows["score"],
                              marker_color=["#d62728" if g else "#1f77b4" for g in rows["generated"]]))
    figure.update_layout(title="Probe score (log-odds of class B) at each token read; red: generated",
                         xaxis_title="token", yaxis_title="log-odds")
    downloads.figure(figure, "probe_monitor", key="probe_monitor")


page_setup("Probes")
run_page(main)
