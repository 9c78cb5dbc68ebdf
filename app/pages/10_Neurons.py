"""Neurons: one MLP neuron (a dense layer's, or a routed or shared expert's) — its activation on the
prompt, the corpus windows where it fires most, and the tokens its output promotes and suppresses directly.
"""

from __future__ import annotations

import streamlit as st

from app import downloads, results
from app.state import LoadedModel
from app.token_widgets import choose_neuron, token_text
from app.url_state import linked
from app.widgets import Prompt, page_setup, progress_callback, prompt_box, require_model, run_page
from experiments import neurons
from experiments.corpus_windows import CORPUS_LABELS, CORPUS_SOURCES
from experiments.plots.common import signed_token_bars
from experiments.plots.token_view import token_html

TOP_K = 10
WINDOW_LENGTHS = (32, 64, 128)


def _activation(loaded: LoadedModel, prompt: Prompt, unit: neurons.MLPUnit, neuron: int) -> None:
    acts = results.neuron_activation(loaded, prompt.ids, unit, neuron)
    ran = acts[acts["routed"]]
    if ran.empty:
        st.info(f"The router sent no token of this prompt to {unit.label}: the neuron never ran here.")
        return
    peak = ran.loc[ran["activation"].idxmax()]
    with st.container(key="neurons_metrics", horizontal=True):
        st.metric("Max activation", f"{peak['activation']:.4f}")
        st.metric("At token", f"{int(peak['position'])}: {peak['token']!r}")
        st.metric("Mean activation", f"{ran['activation'].mean():.4f}")
        if unit.expert is not None:
            st.metric("Tokens routed to this expert", f"{len(ran)} of {len(acts)}")
    name = f"neuron_{unit.label}_{neuron}".replace(" ", "_")
    fig = signed_token_bars(acts, "activation", f"{unit.label}, neuron {neuron}: activation on each token",
                            value_name="activation", x_title="token")
    downloads.figure(fig, name, key="neurons_activation")
    routed_note = " Grey tokens did not go to this expert (it never ran there)." if unit.expert is not None else ""
    st.caption("The prompt coloured by the activation (red positive, blue negative; hover for values)." + routed_note)
    token_text(token_html(prompt.str_tokens, acts["activation"], selected=int(peak["position"]), value_name="activation"),
               name, key="neurons_prompt", title=f"{unit.label}, neuron {neuron}")
    with st.expander("Activations as a table"):
        downloads.table(acts, name, key="neurons_activation_table", height=250)


def _logit_effect(loaded: LoadedModel, unit: neurons.MLPUnit, neuron: int) -> None:
    st.subheader("Direct effect on the logits")
    through_norm = linked(st.toggle, "Through the final norm's gain", value=True, key="neurons_norm_gain")
    effect = results.neuron_logit_effect(loaded, unit, neuron, TOP_K, through_norm)
    how = "times the final norm's gain (its per-token divisor left out) " if through_norm else ""
    router = " before the router weight" if unit.expert is not None else (" before the shared-expert gate" if unit.shared else "")
    st.caption(f"W_out[{neuron}] {how}projected on the unembedding W_U: what one unit of this neuron's activation "
               f"adds to each token's logit directly{router}, past every later layer.")
    promoted, suppressed = (effect[effect["direction"] == d].drop(columns="direction") for d in ("promoted", "suppressed"))
    with st.container(key="neurons_effect", horizontal=True):
        st.metric("Top promoted token", repr(promoted["token"].iloc[0]), help=f"{promoted['effect'].iloc[0]:+.4f}")
        st.metric("Top suppressed token", repr(suppressed["token"].iloc[0]), help=f"{suppressed['effect'].iloc[0]:+.4f}")
    left, right = st.columns(2)
    stem = f"logit_effect_{unit.label}_{neuron}".replace(" ", "_")
    with left:
        st.markdown("**Promoted**")
        downloads.table(promoted, f"{stem}_promoted", key="neurons_promoted")
    with right:
        st.markdown("**Suppressed**")
        downloads.table(suppressed, f"{stem}_suppressed", key="neurons_suppressed")


def _top_windows(loaded: LoadedModel, unit: neurons.MLPUnit, neuron: int) -> None:
    st.subheader("Top-activating windows in the corpus")
    left, text, middle, right = st.columns(4)
    with left:
        search = linked(st.toggle, "Search the corpus", value=True, key="neurons_corpus",
                        help="Computed once for every neuron of this MLP, then read from the disk cache.")
    with text:
        corpus = linked(st.selectbox, "Corpus", options=list(CORPUS_LABELS), format_func=CORPUS_LABELS.get,
                        index=list(CORPUS_LABELS).index(results.model_corpus(loaded)), key="neurons_corpus_text",
                        help="The text scanned: by default the one the model was trained on.")
    with middle:
        n_windows = linked(st.number_input, "Windows", min_value=8, max_value=4096, value=256, step=8,
                           key="neurons_windows")
    lengths = [w for w in WINDOW_LENGTHS if w <= loaded.model.cfg.n_ctx] or [loaded.model.cfg.n_ctx]
    with right:
        window = linked(st.selectbox, "Tokens per window", options=lengths, index=min(1, len(lengths) - 1),
                        key="neurons_window_len")
    if not search:
        return
    maxima = results.neuron_corpus_maxima(loaded, unit, int(n_windows), int(window), bar=progress_callback,
                                          corpus=corpus)
    table, html = results.neuron_top_windows(loaded, maxima, neuron, TOP_K)
    where = f"read from {maxima.path}" if maxima.from_disk else (f"saved to {maxima.path}" if maxima.path else "")
    st.caption(f"{maxima.windows_BP.shape[0]} windows of {window} tokens from the first lines of evenly spaced "
               f"{CORPUS_SOURCES[corpus]}; the BOS position is left out. Every "
               f"neuron of {unit.label} at once, {where}. Each window's highest token is outlined.")
    if table.empty:
        st.info(f"No corpus token went to {unit.label}: the neuron never ran on this corpus.")
        return
    token_text(html, f"top_windows_{unit.label}_{neuron}".replace(" ", "_"),
               key="neurons_top_windows", title=f"{unit.label}, neuron {neuron}: top windows")
    downloads.table(table, f"top_windows_{unit.label}_{neuron}".replace(" ", "_"),
                    key="neurons_top_windows_table", height=250)


def main() -> None:
    st.title("Neurons")
    loaded = require_model()
    if loaded.model.cfg.attn_only:
        st.error("The open model is attention-only: it has no MLP, so no neurons to show. Open a model with MLPs on "
                 "the Home page (SmolLM2, `toy-moe-2l`, or any HF directory).")
        return
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    unit, neuron = choose_neuron(loaded)
    _activation(loaded, prompt, unit, neuron)
    _logit_effect(loaded, unit, neuron)
    _top_windows(loaded, unit, neuron)


page_setup("Neurons")
run_page(main)
