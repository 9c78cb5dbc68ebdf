"""Router (mixture-of-experts models): how much each expert is used per layer, which experts each
token chose, and what happens to the loss when one expert is switched off.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st
import torch

from app import downloads
from app.state import LoadedModel, require_model
from app.widgets import page_setup, prompt_box, run_page
from experiments import router


@st.cache_data(show_spinner="Reading the router …", max_entries=16)
def _routing(_loaded: LoadedModel, model_key: str, ids: tuple[int, ...]) -> tuple[pd.DataFrame, ...]:
    tokens, model = torch.tensor([ids]), _loaded.model
    with _loaded.lock:
        return (router.expert_load(model, tokens), router.token_expert_choices(model, tokens),
                router.router_entropy(model, tokens))


@st.cache_data(show_spinner="Ablating the expert …", max_entries=32)
def _ablate(_loaded: LoadedModel, model_key: str, ids: tuple[int, ...], layer: int, expert: int) -> dict:
    with _loaded.lock:
        return router.expert_ablation_effect(_loaded.model, torch.tensor([ids]), layer, expert)


def _ablation(loaded: LoadedModel, ids: tuple[int, ...]) -> None:
    st.subheader("Switch one expert off")
    cfg = loaded.model.cfg
    left, right = st.columns(2)
    layer = left.selectbox("Layer", range(cfg.n_layers), key="router_layer")
    expert = right.selectbox("Expert", range(cfg.num_experts), key="router_expert")
    effect = _ablate(loaded, loaded.key, ids, int(layer), int(expert))
    cols = st.columns(3)
    cols[0].metric("Mean loss, clean", f"{effect['clean_loss']:.4f}")
    cols[1].metric(f"Mean loss without L{layer} expert {expert}", f"{effect['ablated_loss']:.4f}",
                   delta=f"{effect['delta']:+.4f}", delta_color="inverse")


def main() -> None:
    st.title("Mixture-of-experts router")
    loaded = require_model()
    cfg = loaded.model.cfg
    if not cfg.is_moe:
        st.info("The open model has no mixture of experts, so there is no router to show. Open a mixture-of-experts "
                "model on the Home page (the registered `toy-moe-2l`, or a Mixtral-style HF directory).")
        return
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    load, choices, entropy = _routing(loaded, loaded.key, prompt.ids)
    st.caption(f"Each token is sent to {cfg.experts_per_token} of {cfg.num_experts} experts in every layer.")
    left, right = st.columns([3, 2])
    with left:
        downloads.figure(router.expert_load_figure(load), "expert_load", key="expert_load")
    with right:
        st.markdown("**Router entropy per layer** (nats; uniform routing is "
                    f"{torch.log(torch.tensor(float(cfg.num_experts))).item():.3f})")
        per_layer = entropy.groupby("layer", as_index=False)["entropy"].mean()
        downloads.table(per_layer, "router_entropy", key="router_entropy")
    downloads.table(load, "expert_load", key="expert_load_table", height=200)

    st.subheader("Each token's experts")
    downloads.table(choices, "token_expert_choices", key="token_choices", height=300)
    _ablation(loaded, prompt.ids)


page_setup("Router")
run_page(main)
