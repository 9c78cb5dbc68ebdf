"""Steering: a steering vector from typed contrast pairs (CAA, ActAdd or repeng's PCA reading vector) or from a
saved file (a folder ``SteeringVector.save`` wrote, or a llama.cpp control-vector GGUF); the prompt's clean and
steered continuations side by side; and a coefficient sweep of a behaviour measure (a logit difference or a
token set's probability next after the prompt). Every choice is kept in the page's link; a file path from a link
is read only after a click.
"""

from __future__ import annotations

from typing import Optional

import streamlit as st

from app import downloads
from app.results import steering as steering_view
from app.safe_text import quoted
from app.state import LoadedModel
from app.url_state import linked
from app.widgets import Prompt, page_setup, prompt_box, require_model, run_page
from experiments.plots.continuations import highlighted_html
from experiments.steering import METHODS, SteeringVector
from experiments.plots.steering import sweep_figure

PAIRS, FILE = "Typed contrast pairs", "A saved file"
METHOD_LABELS = {"caa": "CAA (mean difference)", "actadd": "ActAdd (one pair)", "pca": "PCA reading vector (repeng)"}
MAX_NEW_TOKENS = 64
_VECTOR, _SHOWN, _SWEPT = "_steering_vector", "_steering_shown", "_steering_swept"


def _vector(loaded: LoadedModel) -> Optional[SteeringVector]:
    """The vector chosen (trained from the pairs, or read from a file after a click); None after saying why."""
    source = linked(st.radio, "Vector from", options=[PAIRS, FILE], horizontal=True, key="steering_source")
    n_layers = loaded.model.cfg.n_layers
    if source == PAIRS:
        text = linked(st.text_area, "Contrast pairs (one per line: positive | negative)",
                      value=steering_view.DEFAULT_PAIRS, height=110, key="steering_pairs")
        cols = st.columns(3)
        with cols[0]:
            method = linked(st.selectbox, "Method", options=list(METHODS), format_func=METHOD_LABELS.get,
                            key="steering_method")
        with cols[1]:
            layers = linked(st.multiselect, "Layers (block outputs)", options=list(range(n_layers)),
                            default=[n_layers // 2], key="steering_layers")
        with cols[2]:
            read = linked(st.number_input, "Read token index", min_value=-8, max_value=-1, value=-1, step=1,
                          key="steering_read_token", help="Which token of each prompt is read: -1 the last.")
        if not layers:
            st.warning("Pick at least one layer.")
            return None
        pairs = steering_view.parse_pairs(text)
        settings = (loaded.key, "pairs", tuple(pairs), method, tuple(sorted(layers)), int(read))
        if st.session_state.get(_VECTOR, (None,))[0] != settings:
            with st.spinner("Training the vector …"):
                vector = steering_view.vector_from_pairs(loaded, pairs, method, sorted(layers), int(read))
            st.session_state[_VECTOR] = (settings, vector)
    else:
        path = linked(st.text_input, "Path (a saved vector's folder or a .gguf control vector)", value="",
                      key="steering_path")
        settings = (loaded.key, "file", path.strip())
        if st.button("Load the vector", key="steering_load"):
            st.session_state[_VECTOR] = (settings, steering_view.vector_from_file(path))
        if st.session_state.get(_VECTOR, (None,))[0] != settings:
            st.info("Press Load the vector to read the file.")
            return None
    vector = st.session_state[_VECTOR][1]
    layers_text = ", ".join(str(layer) for layer in sorted(vector.layer_activations))
    norms = ", ".join(f"{float(d.norm()):.3g}" for _, d in sorted(vector.layer_activations.items()))
    st.caption(f"Vector at layers {layers_text} (norms {norms}), d_model {vector.d_model}.")
    return vector


def _generations(loaded: LoadedModel, vector: SteeringVector, prompt: Prompt, coefficient: float) -> None:
    st.subheader("Clean and steered generations")
    cfg = loaded.model.cfg
    room = (cfg.context_limit or len(prompt.ids) + MAX_NEW_TOKENS) - len(prompt.ids)
    if room < 1:
        st.error(f"The prompt fills the model's context ({cfg.n_ctx} tokens): shorten it to leave room to generate.")
        return
    top = min(MAX_NEW_TOKENS, room)
    new = linked(st.number_input, "New tokens (greedy)", min_value=1, max_value=top, value=min(20, top), step=1,
                 key="steering_new_tokens")
    settings = (st.session_state[_VECTOR][0], prompt.ids, float(coefficient), int(new))
    if st.button("Generate", key="steering_generate", type="primary"):
        st.session_state[_SHOWN] = (settings, steering_view.continuations(loaded, vector, prompt.ids,
                                                                          float(coefficient), int(new)))
    if st.session_state.get(_SHOWN, (None,))[0] != settings:
        st.info("Press Generate to continue the prompt, clean and steered.")
        return
    result = st.session_state[_SHOWN][1]
    where = result.first_divergence
    st.metric("First divergence", "none" if where is None else f"step {where}")
    left, right = st.columns(2)
    for column, title, tokens, key in ((left, "Clean", result.clean_str_tokens, "steering_clean"),
                                       (right, f"Steered ({result.targets[0]})", result.ablated_str_tokens,
                                        "steering_steered")):
        with column:
            st.markdown(f"**{quoted(title)}**")
            with st.container(key=key, border=True):   # st.html: token text is never read as markdown or LaTeX
                st.html(f'<div style="white-space: pre-wrap">{highlighted_html(tokens, where)}</div>')
    downloads.table(result.to_frame(), "steering_continuations", key="steering_table", height=250)


def _sweep(loaded: LoadedModel, vector: SteeringVector, prompt: Prompt) -> None:
    st.subheader("Coefficient sweep")
    cols = st.columns(4)
    with cols[0]:
        measure = linked(st.selectbox, "Measure", options=list(steering_view.MEASURES), key="steering_measure")
    with cols[1]:
        tokens = linked(st.text_input, "Tokens (comma-separated; logit difference: promoted, compared)",
                        value=" good, bad", key="steering_tokens")
    with cols[2]:
        low, high = linked(st.slider, "Coefficients", min_value=-64.0, max_value=64.0, value=(-8.0, 8.0), step=0.5,
                           key="steering_range")
    with cols[3]:
        points = linked(st.number_input, "Points", min_value=2, max_value=steering_view.MAX_SWEEP_POINTS, value=9,
                        step=1, key="steering_points")
    token_list = [token for token in tokens.split(",") if token.strip()]
    values = steering_view.coefficients(float(low), float(high), int(points))
    settings = (st.session_state[_VECTOR][0], prompt.ids, measure, tuple(token_list), tuple(values))
    if st.button("Run the sweep", key="steering_run_sweep"):
        st.session_state[_SWEPT] = (settings, steering_view.sweep(loaded, vector, prompt.ids, measure, token_list,
                                                                  values))
    if st.session_state.get(_SWEPT, (None,))[0] != settings:
        st.info("Press Run the sweep to measure the prompt at each coefficient.")
        return
    table = st.session_state[_SWEPT][1]
    label = (f"logit({token_list[0]!r}) - logit({token_list[1]!r})" if measure == "logit difference"
             else f"P({', '.join(repr(t) for t in token_list)})")
    downloads.figure(sweep_figure(table, quoted(label), "Behaviour against the coefficient"), "steering_sweep",
                     key="steering_sweep")
    downloads.table(table, "steering_sweep", key="steering_sweep_table", height=200)


def main() -> None:
    st.title("Steering")
    loaded = require_model()
    vector = _vector(loaded)
    if vector is None:
        return
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    coefficient = linked(st.number_input, "Coefficient (multiplier)", min_value=-1000.0, max_value=1000.0, value=4.0,
                         step=0.5, key="steering_coefficient")
    _generations(loaded, vector, prompt, coefficient)
    _sweep(loaded, vector, prompt)


page_setup("Steering")
run_page(main)
