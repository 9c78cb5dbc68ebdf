"""Induction: score every head on repeated random tokens (with a progress bar), and compare the
loss on the first and second copy of the sequence, where induction heads lower it.

Legend: H n_heads, L n_layers.
"""

from __future__ import annotations

import streamlit as st

from app import downloads, results
from app.state import LoadedModel
from app.url_state import linked
from app.widgets import page_setup, progress_callback, require_model, run_page
from experiments import induction
from experiments.plots.common import scores_heatmap
from experiments.plots.induction import induction_loss_figure


def _settings(loaded: LoadedModel) -> tuple[int, int, int]:
    """Sequence length, batch and seed, bounded by what the model's context and vocabulary allow."""
    cfg = loaded.model.cfg
    longest = max(1, min((cfg.n_ctx - 1) // 2, cfg.d_vocab - 1, 512))
    with st.form("induction_settings", border=False):
        cols = st.columns(3)
        with cols[0]:
            seq_len = linked(st.number_input, "Tokens per copy", min_value=1, max_value=longest,
                             value=min(50, longest), key="induction_seq_len", in_form=True,
                             help="Each sequence is [BOS] + r + r for r random tokens without repeats.")
        with cols[1]:
            batch = linked(st.number_input, "Sequences", min_value=1, max_value=64, value=10, key="induction_batch",
                           in_form=True)
        with cols[2]:
            seed = linked(st.number_input, "Seed", min_value=0, max_value=2**31 - 1, value=0, key="induction_seed",
                          in_form=True)
        st.form_submit_button("Run scan", type="primary")
    return int(seq_len), int(batch), int(seed)


def main() -> None:
    st.title("Induction heads")
    st.caption("An induction head attends from a token in the second copy to the token after its earlier "
               "occurrence; its score is the mean attention on that stripe.")
    loaded = require_model()
    seq_len, batch, seed = _settings(loaded)
    scores_LH = results.induction_scores(loaded, seq_len, batch, seed, bar=progress_callback)
    left, right = st.columns([3, 2])
    with left:
        fig = scores_heatmap(scores_LH, f"Induction score ({batch} x 2 x {seq_len} random tokens)")
        downloads.figure(fig, "induction_scores", key="induction_scores", stretch=False)
    with right:
        st.markdown("**Top heads**")
        downloads.table(induction.top_heads(scores_LH, 10), "induction_top_heads", key="induction_top")

    st.subheader("Loss on the first and second copy")
    loss = results.induction_loss(loaded, seq_len, batch, seed)
    means = loss.groupby("copy")["loss"].mean()
    cols = st.columns(3)
    cols[0].metric("Mean loss, first copy", f"{means['first']:.3f}")
    cols[1].metric("Mean loss, second copy", f"{means['second']:.3f}",
                   delta=f"{means['second'] - means['first']:+.3f}", delta_color="inverse")
    downloads.figure(induction_loss_figure(loss), "induction_loss", key="induction_loss")
    downloads.table(loss, "induction_loss", key="induction_loss_table", height=250)


page_setup("Induction")
run_page(main)
