"""Token view: the prompt as coloured text (CircuitsVis-style). Select a token and colour every token by the
attention it gets from the selected one (or pays to it) for one head or a layer's mean; or colour the
prompt by an MLP neuron's activation, or by the change in each token's loss under the Ablation page's ablation.

Legend: L n_layers, H n_heads, P position, S key position.
"""

from __future__ import annotations

import math
from typing import Optional

import streamlit as st

from app import downloads, results
from app.ablation_picker import choose_method, choose_targets, reference_rows
from app.state import LoadedModel
from app.token_widgets import choose_neuron, token_text
from app.url_state import linked
from app.widgets import Prompt, page_setup, prompt_box, require_model, run_page
from experiments import token_view
from experiments.plots.token_view import token_html

MODES = {"attention": "Attention", "neuron": "A neuron's activation", "ablation": "Loss change under an ablation"}
DIRECTION_LABELS = {"from_selected": "Paid by the selected token (its row)",
                    "to_selected": "Paid to the selected token (its column)"}


def _attention(loaded: LoadedModel, prompt: Prompt, token: int) -> tuple[list, str, str]:
    cfg = loaded.model.cfg
    left, middle, right = st.columns(3)
    with left:
        layer = linked(st.selectbox, "Layer", options=list(range(cfg.n_layers)), key="token_view_layer")
    with middle:
        head = linked(st.selectbox, "Head", options=["mean"] + list(range(cfg.n_heads)), key="token_view_head",
                      format_func=lambda h: "mean over the layer's heads" if h == "mean" else f"L{layer}H{h}")
    with right:
        direction = linked(st.radio, "Attention", options=list(token_view.DIRECTIONS), format_func=DIRECTION_LABELS.get,
                           key="token_view_direction")
    patterns_LHPS = results.attention_patterns(loaded, prompt.ids)
    values_P = token_view.selected_attention(patterns_LHPS, layer, None if head == "mean" else int(head), token, direction)
    who = "mean" if head == "mean" else f"H{head}"
    what = "from" if direction == "from_selected" else "to"
    return values_P.tolist(), "attention", f"attention_L{layer}{who}_{what}_token{token}"


def _neuron(loaded: LoadedModel, prompt: Prompt) -> Optional[tuple[list, str, str]]:
    if loaded.model.cfg.attn_only:
        st.error("The open model is attention-only: it has no MLP neurons to colour the prompt by.")
        return None
    unit, neuron = choose_neuron(loaded)
    acts = results.neuron_activation(loaded, prompt.ids, unit, neuron)
    if unit.expert is not None:
        st.caption("Grey tokens did not go to this expert: it never ran there.")
    return acts["activation"].tolist(), "activation", f"neuron_{unit.label}_{neuron}".replace(" ", "_")


def _ablation(loaded: LoadedModel, prompt: Prompt) -> Optional[tuple[list, str, str]]:
    st.caption("The ablation chosen here is the Ablation page's (the choice follows you between the pages).")
    targets = choose_targets(loaded)
    method = choose_method(targets)
    reference = reference_rows(loaded, prompt, method)
    if not targets:
        st.info("Choose at least one thing to ablate.")
        return None
    per_token, _ = results.ablation_effects(loaded, prompt.ids, targets, method, reference)
    st.caption("Each token is coloured by the change in the loss of predicting it (ablated − clean; red: worse). "
               "The first token is predicted by nothing, so it has no value.")
    values = token_view.per_position(per_token, "delta", len(prompt.ids))
    return values, "loss change", f"loss_change_{method}"


def _choose_token(prompt: Prompt) -> int:
    n = len(prompt.ids)
    return linked(st.selectbox, "Selected token", options=list(range(n)), index=n - 1, key="token_view_token",
                  format_func=lambda p: f"{p}: {prompt.str_tokens[p]!r}")


def main() -> None:
    st.title("Token view")
    loaded = require_model()
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    left, right = st.columns([1, 2])
    with left:
        token = _choose_token(prompt)
    with right:
        mode = linked(st.radio, "Colour the tokens by", options=list(MODES), format_func=MODES.get, horizontal=True,
                      key="token_view_mode")
    shown = {"attention": lambda: _attention(loaded, prompt, token), "neuron": lambda: _neuron(loaded, prompt),
             "ablation": lambda: _ablation(loaded, prompt)}[mode]()
    if shown is None:
        return
    values, value_name, name = shown
    with st.container(key="token_view_selected", horizontal=True):
        value = values[token]
        st.metric(f"{value_name.capitalize()} at the selected token", "none" if math.isnan(value) else f"{value:.4f}")
        st.metric("Selected token", f"{token}: {prompt.str_tokens[token]!r}")
    token_text(token_html(prompt.str_tokens, values, selected=token, value_name=value_name), name,
               key="token_view_text", title=f"Token view: {name}")
    downloads.table(token_view.token_values(prompt.str_tokens, values, value_name), name, key="token_view_values",
                    height=250)


page_setup("Token view")
run_page(main)
