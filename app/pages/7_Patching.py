"""Activation patching: run the corrupted prompt with one activation taken from the clean run and see
how much of the clean answer comes back, over the residual stream by position, the attention and MLP
outputs by position, and every head. Exact patching (one rerun per site, behind a button: minutes
on a big model) beside attribution patching (its gradient estimate, at once), with their agreement;
click a head on a heads map to see its attention pattern on the clean prompt.

Legend: P position, S key position, H n_heads, L n_layers.
"""

from __future__ import annotations

from typing import Optional

import pandas as pd
import streamlit as st

from app import downloads, results, url_state
from app.results import PatchPrompts
from app.state import LoadedModel
from app.url_state import linked
from app.widgets import page_setup, progress_callback, prompt_pair, require_model, run_page
from experiments import patching
from experiments.plots import patching as patching_plots
from experiments.plots.attention import pattern_figure

PAIR, DATASET = "Prompt pair", "Generated IOI dataset"
# (kind, heading, attribution sites it compares with)
MAPS = (("resid", "Residual stream (entering each layer) by position", ("resid",)),
        ("attn_mlp", "Attention and MLP outputs by position", ("attn", "mlp")),
        ("heads", "Heads (output over all positions)", ("heads",)))
HEAD_KEY = "patching_head"


def _pair_prompts(loaded: LoadedModel) -> Optional[PatchPrompts]:
    """A clean and a corrupted prompt with answer and wrong tokens, checked; None after saying what is wrong."""
    pair = prompt_pair(loaded.model, "patching")
    if pair is None:
        return None
    if pair.lengths[0] != pair.lengths[1]:
        st.info(f"The clean prompt is {pair.lengths[0]} tokens and the corrupted one {pair.lengths[1]}: the shorter is padded "
                "at its end (pads are masked out), position p is patched into position p, and each prompt's logit "
                "difference is read at its own last token. Prompts of equal length line up best.")
    return (pair.clean,), (pair.corrupt,), (pair.answer,), (pair.wrong,)


def _dataset_prompts(loaded: LoadedModel) -> PatchPrompts:
    """IOI prompts from ``experiments.datasets.ioi_dataset`` (each corrupted twin swaps the subject's repeat)."""
    left, right = st.columns(2)
    with left:
        n = linked(st.number_input, "Prompts", min_value=1, max_value=64, value=8, step=1, key="patching_n")
    with right:
        seed = linked(st.number_input, "Seed", min_value=0, max_value=1_000_000, value=0, step=1, key="patching_seed")
    prompts = results.ioi_prompts(loaded, int(n), int(seed))
    clean, corrupt, answers, wrongs = prompts
    st.caption("Each corrupted prompt repeats the other name, so its answer flips. Templates differ in length and "
               "pad at their end: the position maps average the prompts position by position.")
    with st.expander(f"The {len(clean)} prompt pairs"):
        to_str = loaded.model.to_single_str_token
        downloads.table(pd.DataFrame({"clean": clean, "corrupt": corrupt, "answer_token": [to_str(a) for a in answers],
                                      "wrong_token": [to_str(w) for w in wrongs]}), "patching_ioi_prompts",
                        key="patching_prompts_table", height=200)
    return prompts


def _unpatched_metrics(approx: pd.DataFrame, n_prompts: int) -> None:
    mean = f" (mean of {n_prompts})" if n_prompts > 1 else ""
    with st.container(key="patching_metrics"):
        cols = st.columns(3)
        clean, corrupt = approx.attrs["clean_metric"], approx.attrs["corrupt_metric"]
        cols[0].metric(f"Clean logit diff{mean}", f"{clean:.4f}", help="logit[answer] - logit[wrong] at the last token")
        cols[1].metric(f"Corrupted logit diff{mean}", f"{corrupt:.4f}", delta=f"{corrupt - clean:+.4f}")
        cols[2].metric("Prompt pairs", n_prompts)


def _exact_runs(loaded: LoadedModel, prompts: PatchPrompts, n_sites: int) -> dict[str, pd.DataFrame]:
    """The exact patching tables already computed, or all of them when the button is pressed."""
    pressed = st.button(f"Run exact patching ({n_sites:,} sites, one patched run each)", key="patching_exact",
                        help="Batched reruns of the corrupted prompt; a progress bar shows each map's progress.")
    return {kind: results.exact_patching(loaded, kind, prompts, bar=progress_callback)
            for kind, _, _ in MAPS if pressed or results.has_exact_patching(loaded, kind, prompts)}


def _follow_click(clicked: Optional[tuple[int, int]], key: str) -> None:
    """A new click on a heads map chooses that head (a selection that stays on the map is applied once)."""
    last = f"_patching_clicked_{key}"
    if clicked is not None and st.session_state.get(last) != clicked:
        st.session_state[last] = clicked
        url_state.choose(HEAD_KEY, clicked)


def _map(kind: str, heading: str, sites: tuple[str, ...], exact: Optional[pd.DataFrame], approx: pd.DataFrame) -> None:
    st.subheader(heading)
    estimate = approx[approx["site"].isin(sites)]
    left, right = st.columns(2)
    for column, table, method, value in ((left, exact, "exact", "delta"), (right, estimate, "attribution", "attribution")):
        with column:
            if table is None:
                st.info("Exact patching has not run yet: press the button above.")
                continue
            title = f"{method.capitalize()}: change in logit diff"
            key, name = f"patching_{kind}_{method}", f"patching_{kind}_{method}"
            if kind == "heads":
                points = downloads.figure(patching_plots.head_map_figure(table, title, value), name, key=key, on_select="rerun")
                _follow_click((int(points[0]["y"]), int(points[0]["x"])) if points else None, key)
            else:
                downloads.figure(patching_plots.patching_heatmap(table, title, value), name, key=key)
            downloads.table(table, name, key=f"{key}_table", height=160)
    if exact is not None:
        agreement = patching.attribution_agreement(exact, approx)
        with st.container(key=f"patching_agreement_{kind}"):
            cols = st.columns(2)
            cols[0].metric("Correlation, exact vs attribution", f"{agreement['pearson_r']:.3f}",
                           help=f"Pearson r of the exact delta and its estimate over {agreement['sites']} sites")
            cols[1].metric("Same sign", f"{agreement['sign_agreement']:.0%}",
                           help=f"over the {agreement['signed_sites']} sites whose exact effect is at least "
                                f"{patching.SIGN_FLOOR:.0%} of the largest")


def _head_pattern(loaded: LoadedModel, clean_text: str, approx: pd.DataFrame, which: str) -> None:
    """The chosen head's pattern on ``clean_text`` (``which`` prompt that is); the head follows clicks on the maps."""
    st.subheader(f"One head's attention on {which}")
    cfg, model = loaded.model.cfg, loaded.model
    heads = approx[approx["site"] == "heads"]
    top = heads.loc[heads["attribution"].abs().idxmax()]
    options = [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)]
    layer, head = linked(st.selectbox, "Head (or click a cell of a heads map)", options=options,
                         index=options.index((int(top["layer"]), int(top["head"]))),
                         format_func=lambda lh: f"L{lh[0]}H{lh[1]}", key=HEAD_KEY)
    tokens = model.to_tokens(clean_text)
    patterns_LHPS = results.attention_patterns(loaded, tuple(tokens[0].tolist()))
    fig = pattern_figure(patterns_LHPS[layer, head], model.to_str_tokens(tokens[0]),
                         f"L{layer}H{head}: attention on {which}")
    downloads.figure(fig, f"patching_pattern_L{layer}H{head}", key="patching_head_pattern", stretch=False)


def main() -> None:
    st.title("Activation patching")
    loaded = require_model()
    cfg = loaded.model.cfg
    if loaded.model.tokenizer is None:
        st.info("This model has no tokenizer, and the patching page takes its prompts as text.")
        return
    source = linked(st.radio, "Prompts", options=[PAIR, DATASET], horizontal=True, key="patching_source")
    prompts = _pair_prompts(loaded) if source == PAIR else _dataset_prompts(loaded)
    if prompts is None:
        return
    approx = results.attribution_patching(loaded, prompts)
    _unpatched_metrics(approx, len(prompts[0]))
    st.caption("Each map scores patching one site of the corrupted run with the clean run's activation: the change in "
               "logit[answer] - logit[wrong] (exact, left) and attribution patching's first-order estimate of that "
               "change from one backward pass (right). Blue: the patch moves towards the clean answer; red: away from it.")
    exact = _exact_runs(loaded, prompts, len(approx))
    if cfg.attn_only:
        st.info("This model is attention-only: it has no MLP blocks, so the attention and MLP map shows attention "
                "outputs only.")
    for kind, heading, sites in MAPS:
        _map(kind, heading, sites, exact.get(kind), approx)
    _head_pattern(loaded, prompts[0][0], approx, "the clean prompt" if len(prompts[0]) == 1 else "the first clean prompt")


page_setup("Activation patching")
run_page(main)
