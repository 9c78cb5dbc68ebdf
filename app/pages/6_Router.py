"""Router (mixture-of-experts models): how much each expert is used per layer, which experts each
token chose, what the shared expert writes beside the routed ones, and what happens to the loss
when one expert is switched off.

Only the layers with experts are shown (DeepSeek's first layers are dense MLPs), each with its own
expert count.
"""

from __future__ import annotations

import math

import pandas as pd
import streamlit as st

from app import downloads, results
from app.state import LoadedModel
from app.url_state import linked
from app.widgets import Prompt, page_setup, prompt_box, require_model, run_page
from experiments.plots import router as router_plots


def _ablation(loaded: LoadedModel, ids: tuple[int, ...]) -> None:
    st.subheader("Switch one expert off")
    cfg = loaded.model.cfg
    left, right = st.columns(2)
    # Streamlit resets a select box whose options changed, so another layer's expert count is never out of range.
    with left:
        layer = linked(st.selectbox, "Layer", options=cfg.moe_layers, key="router_layer")
    experts = list(range(cfg.layer_values("num_experts")[int(layer)]))
    with right:
        expert = linked(st.selectbox, "Expert", options=experts, key="router_expert")
    effect = results.expert_ablation_effect(loaded, ids, int(layer), int(expert))
    cols = st.columns(3)
    cols[0].metric("Mean loss, clean", f"{effect['clean_loss']:.4f}")
    cols[1].metric(f"Mean loss without L{layer} expert {expert}", f"{effect['ablated_loss']:.4f}",
                   delta=f"{effect['delta']:+.4f}", delta_color="inverse")


def _routing_caption(cfg) -> str:
    moe, chosen, experts = cfg.moe_layers, cfg.layer_values("experts_per_token"), cfg.layer_values("num_experts")
    if len({(chosen[l], experts[l]) for l in moe}) == 1:
        text = (f"Each token is sent to {chosen[moe[0]]} of {experts[moe[0]]} experts in each of the {len(moe)} "
                f"mixture-of-experts layers (of {cfg.n_layers}).")
    else:
        text = "Experts each token is sent to, by layer: " + "; ".join(
            f"layer {l}: {chosen[l]} of {experts[l]}" for l in moe) + "."
    dense = [l for l in range(cfg.n_layers) if l not in moe]
    if len(dense) == 1:
        text += f" Layer {dense[0]} is a dense MLP with no router and is not shown."
    elif dense:
        text += f" Layers {', '.join(map(str, dense))} are dense MLPs with no router and are not shown."
    return text


def _shared_experts(shared: pd.DataFrame, prompt: Prompt) -> None:
    st.subheader("Shared vs routed experts")
    st.caption("What each layer's MLP writes to the residual stream, split into the shared expert every token runs "
               "(its gate included) and the weighted sum of the routed experts: L2 norms at each position, and the "
               "shared expert's share |shared| / (|routed| + |shared|).")
    downloads.figure(router_plots.shared_vs_routed_figure(shared, prompt.str_tokens), "shared_vs_routed",
                     key="shared_vs_routed")
    downloads.table(shared, "shared_vs_routed", key="shared_vs_routed_table", height=200)


def main() -> None:
    st.title("Mixture-of-experts router")
    loaded = require_model()
    cfg = loaded.model.cfg
    if not cfg.is_moe:
        st.info("The open model has no mixture of experts, so there is no router to show. Open a mixture-of-experts "
                "model on the Home page (the registered `toy-moe-2l`, or an HF directory of Mixtral, Qwen2/3-MoE, "
                "DeepSeek-V2/V3 or gpt-oss).")
        return
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    load, choices, entropy, shared = results.routing(loaded, prompt.ids)
    st.caption(_routing_caption(cfg))
    left, right = st.columns([3, 2])
    with left:
        downloads.figure(router_plots.expert_load_figure(load), "expert_load", key="expert_load")
    with right:
        scores = ("sigmoid scores normalised to sum to one" if cfg.moe.router_scoring == "sigmoid"
                  else "softmax over all experts' logits")
        st.markdown(f"**Router entropy per layer** (nats, of the router's {scores}; `uniform` is the "
                    "entropy of uniform routing)")
        per_layer = entropy.groupby("layer", as_index=False)["entropy"].mean()
        per_layer["uniform"] = [math.log(cfg.layer_values("num_experts")[l]) for l in per_layer["layer"]]
        downloads.table(per_layer, "router_entropy", key="router_entropy")
    downloads.table(load, "expert_load", key="expert_load_table", height=200)

    st.subheader("Each token's experts")
    downloads.table(choices, "token_expert_choices", key="token_choices", height=300)
    if shared is not None:
        _shared_experts(shared, prompt)
    _ablation(loaded, prompt.ids)


page_setup("Router")
run_page(main)
