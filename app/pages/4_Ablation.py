"""Ablation: knock out heads, layers, neurons or experts (zero, mean or resample) and see how the
loss on each token and the top next-token predictions change; sweep every head as a heatmap.

Legend: H n_heads, L n_layers.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st
import torch

from app import downloads, results
from app.results import Reference, Targets
from app.state import LoadedModel
from app.widgets import Prompt, page_setup, progress_callback, prompt_box, require_model, run_page
from experiments import ablation
from experiments.figures import scores_heatmap, signed_token_bars

KIND_LABELS = {"head": "Heads", "attn_layer": "Attention layers", "mlp_layer": "MLP layers",
               "neuron": "MLP neurons", "expert": "Experts"}
# Mean and resample ablation replace activations by those of other text; these are the default.
DEFAULT_REFERENCES = "\n".join([
    "The history of the region goes back thousands of years, and the first written records describe farmers, "
    "traders and travellers who crossed the river valley on their way to the coast, where markets grew into towns.",
    "To install the package, open a terminal, create a new virtual environment, activate it and run the install "
    "command; then import the module in Python and call the main function with the path to your data file.",
    "She opened the letter slowly, read the first line twice, and then looked out of the window at the rain that "
    "had been falling since the morning, wondering whether he would ever come back to the little house by the sea.",
])


def _sweep(model, ids: tuple[int, ...], method: str, reference, progress) -> pd.DataFrame:
    ref = torch.tensor(reference) if reference else None
    return ablation.head_sweep(model, torch.tensor([ids]), "loss", method, reference_tokens=ref, progress=progress)


def _choose_targets(loaded: LoadedModel) -> Targets:
    """What to ablate: one kind at a time, any number of that kind."""
    cfg = loaded.model.cfg
    kinds = ["head", "attn_layer"]
    if not cfg.attn_only:
        kinds += ["mlp_layer", "expert" if cfg.is_moe else "neuron"]
    kind = st.radio("Ablate", kinds, format_func=KIND_LABELS.get, horizontal=True, key="ablation_kind")
    layers = range(cfg.n_layers)
    if kind == "head":
        options = [(l, h) for l in layers for h in range(cfg.n_heads)]
        chosen = st.multiselect("Heads", options, default=[options[-cfg.n_heads]], key="ablation_heads",
                                format_func=lambda lh: f"L{lh[0]}H{lh[1]}")
        return tuple(("head", l, h) for l, h in chosen)
    if kind in ("attn_layer", "mlp_layer"):
        chosen = st.multiselect("Layers", layers, default=[0], key=f"ablation_{kind}s")
        return tuple((kind, l, None) for l in chosen)
    if kind == "expert":  # only the layers with experts, each with its own count
        layer = st.selectbox("Layer", cfg.moe_layers, key="ablation_unit_layer")
        n_experts = cfg.layer_values("num_experts")[layer]
        chosen = st.multiselect("Experts", range(n_experts), default=[0], key="ablation_experts")
        return tuple(("expert", layer, e) for e in chosen if e < n_experts)
    layer = st.selectbox("Layer", layers, key="ablation_unit_layer")
    d_mlp = cfg.layer_values("d_mlp")[layer]
    text = st.text_input(f"Neurons (0..{d_mlp - 1}, comma separated)", "0, 1, 2", key="ablation_neurons")
    try:
        neurons = sorted({int(part) for part in text.replace(" ", "").split(",") if part})
    except ValueError:
        st.error(f"Neurons must be whole numbers separated by commas, got “{text}”.")
        return ()
    return tuple(("neuron", layer, n) for n in neurons)


def _reference(loaded: LoadedModel, prompt: Prompt, method: str) -> Reference:
    """Token ids of the reference prompts, each cut to the prompt's length (None for zero ablation)."""
    if method == "zero":
        return None
    text = st.text_area("Reference text for mean / resample (one prompt per line)", DEFAULT_REFERENCES,
                        key="ablation_reference", height=110,
                        help="Mean: each activation is replaced by its mean over these prompts at the same position. "
                             "Resample: by its value on one of them. Lines shorter than the prompt are skipped.")
    n = len(prompt.ids)
    rows = [tuple(loaded.model.to_tokens(line)[0, :n].tolist()) for line in text.splitlines() if line.strip()]
    rows = [row for row in rows if len(row) == n]
    if not rows:
        st.error(f"Mean and resample ablation need at least one reference line of {n} tokens or more "
                 "(the prompt's length).")
        st.stop()
    return tuple(rows)


def _effects_view(per_token: pd.DataFrame, top: pd.DataFrame) -> None:
    cols = st.columns(3)
    clean, ablated = per_token["clean_loss"].mean(), per_token["ablated_loss"].mean()
    cols[0].metric("Mean loss, clean", f"{clean:.4f}")
    cols[1].metric("Mean loss, ablated", f"{ablated:.4f}", delta=f"{ablated - clean:+.4f}", delta_color="inverse")
    fig = signed_token_bars(per_token, "delta", "Change in loss of predicting each token (ablated - clean)",
                            value_name="loss change", x_title="predicted token", hover=["clean_loss", "ablated_loss"])
    downloads.figure(fig, "ablation_per_token", key="ablation_per_token")
    downloads.table(per_token, "ablation_per_token", key="ablation_per_token_table", height=220)
    st.markdown("**Top next-token predictions after the last token, clean and ablated**")
    downloads.table(top, "ablation_top_predictions", key="ablation_top")


def main() -> None:
    st.title("Ablation")
    loaded = require_model()
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    targets = _choose_targets(loaded)
    experts = any(kind == "expert" for kind, _, _ in targets)
    method = st.radio("Method", ["zero"] if experts else list(ablation.METHODS), horizontal=True,
                      key="ablation_method", help="Experts support zero ablation (their router weight is dropped).")
    reference = _reference(loaded, prompt, method)
    if not targets:
        st.info("Choose at least one thing to ablate.")
    else:
        _effects_view(*results.ablation_effects(loaded, prompt.ids, targets, method, reference))

    st.subheader("Every head, one at a time")
    cfg = loaded.model.cfg
    args = (prompt.ids, method, reference)
    if st.button(f"Run the head sweep ({cfg.n_layers * cfg.n_heads} heads, {method} ablation)", key="ablation_sweep") \
            or results.has_result(loaded, "Sweeping heads", _sweep, *args):
        sweep = results.with_progress(loaded, "Sweeping heads", _sweep, *args, bar=progress_callback)
        delta_LH = torch.tensor(sweep["delta"].values).view(cfg.n_layers, cfg.n_heads)
        fig = scores_heatmap(delta_LH, f"Loss change when {method}-ablating each head", colorscale="RdBu_r",
                             zmid=0.0, value_name="loss change")
        downloads.figure(fig, f"head_sweep_{method}", key="head_sweep", stretch=False)
        downloads.table(sweep, f"head_sweep_{method}", key="head_sweep_table", height=250)


page_setup("Ablation")
run_page(main)
