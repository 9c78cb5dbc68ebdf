"""Widgets the Neurons and Token view pages share: the choice of an MLP neuron (linked, with the same
keys on both pages, so the neuron picked on one is the one the other shows) and coloured token text
with its HTML download.
"""

from __future__ import annotations

import streamlit as st

from app.state import LoadedModel
from app.url_state import linked
from experiments import neurons
from experiments.plots.token_view import html_document

_NEURON_KEY = "neurons_neuron"


def _expert_label(choice) -> str:
    return "shared expert" if choice == "shared" else f"expert {choice}"


def choose_neuron(loaded: LoadedModel) -> tuple[neurons.MLPUnit, int]:
    """Layer, expert (mixture-of-experts layers only: each routed expert, and the shared one) and neuron.

    Raises ``InputError`` (shown by the page guard) for an attention-only model.

    Example:
        >>> unit, neuron = choose_neuron(require_model())   # doctest: +SKIP
        >>> unit.label, neuron                             # doctest: +SKIP
        ('L3 MLP', 17)
    """
    units = neurons.mlp_units(loaded.model)
    layers = sorted({unit.layer for unit in units})
    columns = st.columns(3)
    with columns[0]:
        layer = linked(st.selectbox, "Layer", options=layers, key="neurons_layer")
    in_layer = [unit for unit in units if unit.layer == layer]
    unit = in_layer[0]
    if len(in_layer) > 1:  # a mixture of experts: a neuron belongs to one expert
        choices = ["shared" if u.shared else u.expert for u in in_layer]
        with columns[1]:
            choice = linked(st.selectbox, "Expert", options=choices, format_func=_expert_label, key="neurons_expert")
        unit = in_layer[choices.index(choice)]
    width = unit.width(loaded.model.cfg)
    default = 0
    if st.session_state.get(_NEURON_KEY, 0) >= width:  # kept from a wider MLP: Streamlit would refuse it
        del st.session_state[_NEURON_KEY]
        default = width - 1  # this MLP's last neuron (the saved value no longer fits, so the default is used)
    with columns[2]:
        neuron = linked(st.number_input, "Neuron", min_value=0, max_value=width - 1, value=default, step=1, key=_NEURON_KEY,
                        help=f"{unit.label} has {width} neurons (0..{width - 1}).")
    return unit, int(neuron)


def token_text(fragment: str, name: str, key: str, title: str) -> None:
    """An HTML fragment of coloured tokens (``experiments.plots.token_view.token_html``) under ``key``, with a
    download of it as a standalone page.

    Example:
        >>> token_text(token_html(tokens, values), "neuron_L3N17", key="neurons_prompt", title="L3 N17")   # doctest: +SKIP
    """
    with st.container(key=key):
        st.html(fragment)
    st.download_button("HTML", html_document(fragment, title), f"{name}.html", "text/html", key=f"{key}_html",
                       on_click="ignore", icon=":material/download:", help="The coloured text as a standalone page")
