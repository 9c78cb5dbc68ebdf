"""Logit lens: what each layer's residual stream would predict at each position, and which heads,
MLPs and embeddings push the final logit of a chosen token up or down (direct logit attribution).

Where a tuned lens ships for the model (``workbench/zoo/<model>/lenses/<name>/``), the link's ``lens_kind`` reads the
layers through it instead, and "KL by layer" compares both lenses on the prompt.
"""

from __future__ import annotations

import html
from typing import Optional

import pandas as pd
import streamlit as st

from app import downloads, results
from app.runtime import readout_workers
from app.safe_text import quoted
from app.state import LoadedModel
from app.url_state import follow, linked
from app.widgets import Prompt, page_setup, prompt_box, require_model, run_page
from experiments.plots.lenses import lens_kl_figure
from experiments.plots import lens as lens_plots

LENS_KINDS = {"logit": "Logit lens", "tuned": "Tuned lens (shipped)"}
WINDOW = 16  # positions the grid shows by default
SCREEN_NOTE = (" The vocabulary is screened in bfloat16 and each cell's best tokens scored again in float32: the tokens "
               "are float32's, their probabilities within about 0.002 (see `experiments.lens.logit_lens`'s `screen`).")


def _token_id(loaded: LoadedModel, text: str, what: str) -> int:
    """The id of ``text`` when it is exactly one token; stops the page with a message otherwise."""
    ids = loaded.model.to_tokens(text, prepend_bos=False)[0].tolist()
    if len(ids) != 1:
        st.error(f"The {what} {quoted(text)} is {len(ids)} tokens for this tokenizer; give a single token "
                 "(mind the leading space, e.g. “ Paris”).")
        st.stop()
    return int(ids[0])


def _attribution(loaded: LoadedModel, prompt: Prompt, table: pd.DataFrame) -> None:
    st.subheader("Direct logit attribution")
    n = len(prompt.ids)
    position = linked(st.selectbox, "Position (predicting the token after it)", options=range(n), index=n - 1,
                      format_func=lambda p: f"{p}: {prompt.str_tokens[p]!r}", key="lens_position")
    final = table[(table["layer"] == table["layer"].max()) & (table["position"] == position)].sort_values("rank")
    if final.empty:  # a position outside the grid's window: its own readout (the run is cached)
        top_k = int(table["rank"].max())
        final = results.logit_lens(loaded, prompt.ids, top_k, (position, position))
        final = final[final["layer"] == final["layer"].max()].sort_values("rank")
    top_tokens = final["token"].tolist()
    left, right = st.columns(2)
    with left:
        target_text = linked(st.text_input, "Target token (blank: the model's top prediction)", key="lens_target")
    with right:
        baseline_text = linked(st.text_input, "Baseline token (optional: attribute target minus baseline)",
                               key="lens_baseline")
    target = _token_id(loaded, target_text, "target") if target_text else int(final["token_id"].iloc[0])
    baseline = _token_id(loaded, baseline_text, "baseline") if baseline_text else None
    target_name = target_text or top_tokens[0]
    # Plotly reads HTML tags (links included) in a title: the typed tokens go in escaped.
    title = (f"Direct logit attribution of {html.escape(repr(target_name), quote=False)}"
             + (f" minus {html.escape(repr(baseline_text), quote=False)}" if baseline_text else ""))
    st.caption(f"Top predictions here: {', '.join(quoted(repr(t)) for t in top_tokens)}")
    dla = results.direct_logit_attribution(loaded, prompt.ids, target, baseline, position)
    downloads.figure(lens_plots.dla_figure(dla, title), "direct_logit_attribution", key="dla")
    st.caption(f"The components sum exactly to the logit difference {dla.attrs['logit_diff']:.4f}; "
               f"weights: {dla.attrs['weights']} (the final norm is read from the model either way).")
    downloads.table(dla.sort_values("attribution", key=abs, ascending=False), "direct_logit_attribution",
                    key="dla_table", height=250)


def _positions_window(prompt: Prompt) -> Optional[tuple[int, int]]:
    """The first and last position the grid reads: by default the last ``WINDOW`` (the prediction being built at
    the end, the grid one screen wide; each column costs a readout of every layer through the whole vocabulary);
    a new prompt brings the default back."""
    n = len(prompt.ids)
    if n <= WINDOW:
        return None
    follow("lens_window", prompt.ids, "lens_positions")
    first, last = linked(st.slider, "Positions shown", min_value=0, max_value=n - 1, value=(n - WINDOW, n - 1),
                         key="lens_positions")
    return first, last


def main() -> None:
    st.title("Logit lens")
    loaded = require_model()
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    top_k = linked(st.slider, "Top tokens kept per layer and position", min_value=1, max_value=10, value=5,
                   key="lens_top_k")
    window = _positions_window(prompt)
    # The tuned lens shipped for the open model (by its config name or the registered name it was opened by).
    tuned_path = next(iter(results.artifact_choices(loaded, "lens").values()), None)
    kinds = ["logit", "tuned"] if tuned_path is not None else ["logit"]
    kind = linked(st.radio, "Lens", options=kinds, index=0, format_func=LENS_KINDS.get, horizontal=True,
                  key="lens_kind")
    if kind == "tuned" and tuned_path is not None:
        table = results.tuned_lens_table(loaded, prompt.ids, top_k, results.load_artifact(loaded, "lens", tuned_path),
                                         window, readout_workers())
        st.caption("Rows: the residual stream entering each layer, moved by that layer's tuned-lens translator, "
                   "then read through the final norm and unembedding (card: "
                   f"{tuned_path.relative_to(tuned_path.parents[2])}/CARD.md)."
                   + SCREEN_NOTE * bool(table.attrs.get("screen")))
    else:
        table = results.logit_lens(loaded, prompt.ids, top_k, window, readout_workers())
        st.caption("Rows: the residual stream entering each layer, read through the final norm and unembedding; "
                   "the last row is the model's own prediction. Cells show the top token, coloured by its probability."
                   + SCREEN_NOTE * bool(table.attrs.get("screen")))
    downloads.figure(lens_plots.logit_lens_figure(table, prompt.str_tokens), "logit_lens", key="logit_lens", stretch=False)
    # The expanders are filled only when opened (opening one reruns the page): closed, the table still sent every
    # top-k row (480 KB at 64 tokens) and KL by layer read every layer through the unembedding again, once per lens
    # (on SmolLM2 at 64 tokens most of a 4-9 s prompt change).
    table_view = st.expander("The top-k tokens of the positions shown, as a table", key="lens_table_open",
                             on_change="rerun")
    if table_view.open:
        with table_view:
            downloads.table(table, "logit_lens", key="logit_lens_table", height=300)
    kl_view = (st.expander("KL by layer: how far each layer's readout is from the model's output", key="lens_kl_open",
                           on_change="rerun") if len(prompt.ids) >= 3 else None)
    if kl_view is not None and kl_view.open:
        with kl_view:
            held = results.load_artifact(loaded, "lens", tuned_path) if tuned_path is not None else None
            kl = results.lens_kl(loaded, prompt.ids, held)
            downloads.figure(lens_kl_figure(kl), "lens_kl_by_layer", key="lens_kl")
            st.caption("KL(model's output || lens) in nats, averaged over this prompt's positions that have a next "
                       "token (BOS left out)" + ("" if tuned_path is not None else "; no tuned lens ships for this model"))
    _attribution(loaded, prompt, table)


page_setup("Logit lens")
run_page(main)
