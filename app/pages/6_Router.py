"""Router (mixture-of-experts models): how much each expert is used per layer, which experts each
token chose, and what happens to the loss when one expert is switched off.
"""

from __future__ import annotations

import streamlit as st
import torch

from app import downloads, results
from app.state import LoadedModel
from app.widgets import page_setup, prompt_box, require_model, run_page
from experiments import router


def _ablation(loaded: LoadedModel, ids: tuple[int, ...]) -> None:
    st.subheader("Switch one expert off")
    cfg = loaded.model.cfg
    left, right = st.columns(2)
    layer = left.selectbox("Layer", range(cfg.n_layers), key="router_layer")
    expert = right.selectbox("Expert", range(cfg.num_experts), key="router_expert")
    effect = results.expert_ablation_effect(loaded, ids, int(layer), int(expert))
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
    load, choices, entropy = results.routing(loaded, prompt.ids)
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
