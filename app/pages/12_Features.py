"""Features: browse a sparse autoencoder's features on the open model — the features active on the prompt's
tokens, one feature's card (its activation on the prompt, its corpus top windows and density, the tokens its
decoder direction promotes and suppresses, with the caveat of a mid-layer feature) and a generation steered with
it beside the clean one. Special tokens (BOS, pad) are left out of the heatmap unless the toggle brings them back:
at BOS an SAE's features fire far above anywhere else (near 3,300 against at most 64 on SmolLM2).
"""

from __future__ import annotations

from typing import Optional

import streamlit as st

from app import downloads, feature_card, results
from app.artifact_picker import open_artifact
from app.results.features import LoadedSAE, top_features_by_token
from app.safe_text import quoted
from app.special_tokens import show_special_toggle, special_positions
from app.state import LoadedModel
from app.url_state import linked
from app.widgets import Prompt, page_setup, prompt_box, require_model, run_page
from experiments.plots.continuations import highlighted_html
from experiments.plots.features import active_features_figure

PREFIX = "features"  # the feature card's widget keys (app.feature_card)
PER_TOKEN = 5  # features shown per token in the prompt's overview
STEER_MODES = {"Add to the residual direction": "add", "Clamp the activation": "clamp"}
MAX_NEW_TOKENS = 64
_SHOWN = "_features_shown"  # the settings of the continuations on screen


def _choose_sae(loaded: LoadedModel) -> Optional[LoadedSAE]:
    """The SAE chosen (a shipped one or a path), loaded and checked against the model; None after saying why not."""
    held = open_artifact(loaded, "sae")  # the one picker: shipped SAEs first, a path only after a click
    if held is None:
        return None
    loaded_sae = LoadedSAE(held.artifact, held.key)
    problem = results.fit_error(loaded, loaded_sae)
    if problem is not None:
        st.error(f"This SAE does not fit the open model: {quoted(problem, limit=400)}")
        return None
    cfg = loaded_sae.sae.cfg
    where = cfg.hook_name if cfg.hook_name == cfg.hook_name_out else f"{cfg.hook_name} -> {cfg.hook_name_out}"
    st.caption(f"{quoted(cfg.architecture())} {'transcoder' if cfg.is_transcoder else 'SAE'} with {cfg.d_sae} "
               f"features at {quoted(where)}, read with its error term (the model's output is unchanged).")
    return loaded_sae


def _active_features(loaded: LoadedModel, loaded_sae: LoadedSAE, prompt: Prompt) -> Optional[int]:
    """The prompt's active features; returns the most active feature at the last token that is not a special one
    (the default feature)."""
    st.subheader("Features active on the prompt")
    table = results.active_features(loaded, loaded_sae, prompt.ids, PER_TOKEN)
    include = show_special_toggle("the heatmap and the default feature")
    special = () if include else special_positions(loaded.model, prompt.ids)
    shown = table[~table["position"].isin(special)]
    if shown.empty:
        st.info("No feature of this SAE fires on any token of the prompt"
                + (" (special tokens left out)." if special else "."))
        return None
    fig = active_features_figure(shown, prompt.str_tokens, f"The {PER_TOKEN} most active features at each token")
    downloads.figure(fig, "active_features", key="features_active")
    if special:
        left_out = ", ".join(f"{p} {quoted(repr(prompt.str_tokens[p]))}" for p in special)
        st.caption(f"Special tokens left out of the heatmap and its colour scale: {left_out}.")
    st.markdown(f"**The {PER_TOKEN} most active features at each token**")
    downloads.table(top_features_by_token(shown), "top_features_by_token", key="features_by_token", height=250)
    with st.expander("Active features as a long table (one row per token and rank)"):
        downloads.table(shown, "active_features", key="features_active_table", height=250)
    last = shown[shown["position"] == shown["position"].max()]
    return int(last.sort_values("rank")["feature"].iloc[0])


def _logit_effect_caveat(loaded: LoadedModel, loaded_sae: LoadedSAE) -> None:
    """Says what the promoted and suppressed tokens leave out when the SAE reads a hook before the last layer."""
    hook = loaded_sae.sae.cfg.hook_name_out or loaded_sae.sae.cfg.hook_name
    n_layers = loaded.model.cfg.n_layers
    layer = loaded.model.layer_of(hook)
    after = n_layers if layer is None else n_layers - 1 - layer + (0 if hook.endswith("hook_resid_post") else 1)
    if after <= 0:
        return
    st.info(f"Caveat: this feature writes at {quoted(hook)}, with {after} of the model's {n_layers} layers after "
            "it. The promoted and suppressed tokens are its direct effect through the final norm and the "
            "unembedding only: they ignore what the later layers do with it, so for a mid-layer feature they can "
            "be noise. The steered generation below (or the Attribution graph page) shows its effect through them.",
            icon=":material/info:")


def _steering(loaded: LoadedModel, loaded_sae: LoadedSAE, prompt: Prompt, feature: int) -> None:
    st.subheader("Steer a generation with the feature")
    cfg = loaded.model.cfg
    room = (cfg.context_limit or len(prompt.ids) + MAX_NEW_TOKENS) - len(prompt.ids)
    if room < 1:
        st.error(f"The prompt fills the model's context ({cfg.n_ctx} tokens): shorten it to leave room to generate.")
        return
    cols = st.columns(3)
    with cols[0]:
        mode = linked(st.radio, "Edit", options=list(STEER_MODES), key="features_steer_mode")
    with cols[1]:
        value = linked(st.number_input, "Strength (add: alpha; clamp: the activation)", min_value=-1000.0,
                       max_value=1000.0, value=8.0, step=1.0, key="features_steer_value")
    with cols[2]:
        top = min(MAX_NEW_TOKENS, room)
        new = linked(st.number_input, "New tokens (greedy)", min_value=1, max_value=top, value=min(20, top), step=1,
                     key="features_steer_tokens")
    settings = (loaded.key, loaded_sae.key, prompt.ids, feature, STEER_MODES[mode], float(value), int(new))
    if st.button("Generate", key="features_generate", type="primary"):
        st.session_state[_SHOWN] = settings
    if st.session_state.get(_SHOWN) != settings:
        st.info("Press Generate to continue the prompt, clean and steered.")
        return
    result = results.feature_continuation(loaded, loaded_sae, prompt.ids, feature, STEER_MODES[mode], float(value),
                                          int(new))
    where = result.first_divergence
    st.metric("First divergence", "none" if where is None else f"step {where}")
    left, right = st.columns(2)
    for column, title, tokens, key in ((left, "Clean", result.clean_str_tokens, "features_clean"),
                                       (right, f"Steered ({result.targets[0]})", result.ablated_str_tokens, "features_steered")):
        with column:
            st.markdown(f"**{title}**")
            with st.container(key=key, border=True):  # st.html: token text is never read as markdown or LaTeX
                st.html(f'<div style="white-space: pre-wrap">{highlighted_html(tokens, where)}</div>')
    downloads.table(result.to_frame(), f"feature_{feature}_steering", key="features_steering_table", height=250)


def main() -> None:
    st.title("Features")
    loaded = require_model()
    loaded_sae = _choose_sae(loaded)
    if loaded_sae is None:
        return
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    default = _active_features(loaded, loaded_sae, prompt) or 0
    d_sae = loaded_sae.sae.cfg.d_sae
    feature = int(linked(st.number_input, "Feature", min_value=0, max_value=d_sae - 1, value=min(default, d_sae - 1),
                         step=1, key="features_feature", help=f"This SAE has {d_sae} features (0..{d_sae - 1})."))
    st.header(f"Feature {feature}")
    feature_card.on_prompt(loaded, loaded_sae, prompt, feature, PREFIX)
    feature_card.logit_effect(loaded, loaded_sae, feature, PREFIX)
    _logit_effect_caveat(loaded, loaded_sae)
    feature_card.corpus(loaded, loaded_sae, feature, PREFIX)
    _steering(loaded, loaded_sae, prompt, feature)


page_setup("Features")
run_page(main)
