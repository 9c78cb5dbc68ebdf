"""Home: pick the model every page works on (registered, a path, or from the Hugging Face Hub), see its card
(config, size, hook points, kernel) and a first plot: the default prompt's head whose last token reads content
the most (the Attention page opens on the same cached patterns).

Run with ``make run`` or ``python -m app.serve`` (``streamlit run app/Home.py`` with the default model loading from
launch; plain ``streamlit run app/Home.py`` works too, loading it on the first page run); the other pages are in
``app/pages/``.
"""

from __future__ import annotations

import streamlit as st

from app.serve import preload_plotly_while_warming

preload_plotly_while_warming()  # before the imports below: on a cold start they wait for the server's warm-up

import pandas as pd  # noqa: E402
import torch  # noqa: E402

import workbench as wb  # noqa: E402
from app import downloads, hub_picker, results, state
from app.attention_views import strongest_reader
from app.safe_text import quoted
from app.special_tokens import scale_max, special_positions
from app.widgets import DEFAULT_PROMPT, MAX_PROMPT_TOKENS, open_model, page_setup, run_page
from experiments.plots.attention import pattern_figure

REGISTERED, PATH = "Registered model", "Path on this machine"


def _picker() -> None:
    """Registered name or a path, plus the attention kernel; "Open" makes it the session's model. Below it, a Hub
    repo id (downloaded on a click) or a model of the HF cache (``app.hub_picker``)."""
    models = wb.list_models()
    names = models["name"].tolist()
    installed = dict(zip(models["name"], models["installed"]))
    current = state.model_source()
    with st.form("model_picker"):
        mode = st.radio("Open", [REGISTERED, PATH], horizontal=True, key="home_mode",
                        index=0 if current in names else 1)
        name = st.selectbox("Registered model", names, key="home_name",
                            index=names.index(current) if current in names else 0,
                            format_func=lambda n: n if installed[n] else f"{n} (not installed)")
        path = st.text_input("Path: an HF-format directory, a .gguf file or a directory written by model.save()",
                             value="" if current in names else current, key="home_path")
        impl = st.selectbox("Attention kernel", state.ATTN_IMPLS, key="home_impl",
                            index=state.ATTN_IMPLS.index(state.attn_impl()),
                            help="Patterns are read with the eager kernel on the layers that need them, "
                                 "whatever is chosen here.")
        if st.form_submit_button("Open model", type="primary"):
            source = name if mode == REGISTERED else path
            if not source.strip():
                st.error("Give a path to open, or choose a registered model.")
            else:
                state.choose_model(source, impl)
    with st.expander("Registered models"):
        st.dataframe(models, hide_index=True)
    hub_picker.picker(state.attn_impl())


def _card(loaded: state.LoadedModel, description: str = "") -> None:
    """The open model at a glance: size, shape, hook points, kernel, then every config field."""
    model, cfg = loaded.model, loaded.model.cfg
    st.subheader(f"Open model: {quoted(state.model_source())}")
    if description:
        st.markdown(description)
    cols = st.columns(7)
    cols[0].metric("Parameters", f"{model.n_params / 1e6:,.1f} M" if model.n_params >= 1e6 else f"{model.n_params:,}")
    cols[1].metric("Layers", cfg.n_layers)
    cols[2].metric("Heads (KV heads)", f"{cfg.n_heads} ({cfg.n_key_value_heads})")
    cols[3].metric("Hook points", len(model.hook_dict))
    cols[4].metric("Attention kernel", cfg.attn_impl)
    cols[5].metric("Context", f"{cfg.n_ctx:,}")
    # Every page removes its hooks when its call ends; anything above 0 here is a leak (the load test reads it).
    cols[6].metric("Hooks attached now", sum(model.attached_hooks().values()))
    kind = "attention-only" if cfg.attn_only else (
        f"mixture of experts, top-{cfg.experts_per_token} of {cfg.num_experts} in layers {cfg.moe_layers}"
        if cfg.is_moe else "dense MLP")
    st.caption(f"{cfg.n_layers} layers of d_model={cfg.d_model}, {kind}, {cfg.positional} positions, "
               f"{cfg.normalization} norm, vocabulary of {cfg.d_vocab:,}.")
    config = pd.DataFrame({"field": list(cfg.to_dict()), "value": [str(v) for v in cfg.to_dict().values()]})
    with st.expander("Full config", expanded=False):
        st.dataframe(config, hide_index=True)
    st.markdown("Explore it on the pages in the sidebar: **Attention**, **Heads**, **Induction**, **Ablation**, "
                "**Logit lens**, **Router** (mixture-of-experts models), **Patching**, **Information flow**, "
                "**Token view**, **Neurons** and **Generate**. Every page keeps its state in its link: copy the "
                "address to share the view.")


def _first_plot(loaded: state.LoadedModel) -> None:
    """The default prompt's strongest content-reading head (``strongest_reader``), its pattern with special tokens
    out of the colour scale: the same cached patterns the Attention page draws."""
    model = loaded.model
    ids = tuple(int(i) for i in model.to_tokens(DEFAULT_PROMPT)[0].tolist())
    if len(ids) > min(MAX_PROMPT_TOKENS, model.cfg.n_ctx):
        return  # a model with a tiny context: its pages say how long a prompt may be
    patterns_LHPS = results.attention_patterns(loaded, ids)
    special = special_positions(model, ids)
    layer, head = strongest_reader(patterns_LHPS, special)
    st.subheader(f"First look: L{layer}H{head}, the head whose last token reads the prompt most")
    fig = pattern_figure(patterns_LHPS[layer, head], model.to_str_tokens(torch.tensor(ids)), f"L{layer}H{head}")
    fig.update_traces(zmin=0, zmax=scale_max(patterns_LHPS[layer, head], special, axes=(0, 1)))
    downloads.figure(fig, f"attention_L{layer}H{head}", key="home_pattern", stretch=False)
    st.caption("The default prompt's attention (special tokens left out of the colour scale). Every head, your own "
               "prompt and more views are on the **Attention** page.")


def main() -> None:
    st.title("Mechanistic-interpretability workbench")
    _picker()
    loaded = open_model()
    if loaded is not None:
        models = wb.list_models().set_index("name")["description"]
        _card(loaded, models.get(state.model_source(), ""))
        _first_plot(loaded)


page_setup("Workbench")
run_page(main)
