"""Generate: continue the prompt with the open model, clean and with the ablation chosen on the Ablation
page applied, side by side (same decoding settings and seed); the tokens from the first place they
part are highlighted, and a table lists both continuations' tokens with the model's log-prob of each.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Optional

import streamlit as st

from app import downloads, results
from app.ablation_picker import choose_method, choose_targets, reference_rows
from app.state import LoadedModel
from app.url_state import linked
from app.widgets import Prompt, page_setup, prompt_box, require_model, run_page
from experiments.continuations import Continuations
from experiments.plots.continuations import highlighted_html

GREEDY, SAMPLE = "Greedy", "Sample"
MAX_NEW_TOKENS = 64
_SHOWN = "_generate_shown"  # the settings of the continuations on screen (drawn again on every rerun)


@dataclass(frozen=True)
class Decoding:
    """How to pick each next token (greedy is temperature 0)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: Optional[int] = None
    seed: int = 0


def _decoding(loaded: LoadedModel, prompt: Prompt) -> Optional[Decoding]:
    """The decoding settings (linked widgets), or None when the prompt leaves no room in the context."""
    cfg = loaded.model.cfg
    room = (cfg.context_limit or len(prompt.ids) + MAX_NEW_TOKENS) - len(prompt.ids)
    if room < 1:
        st.error(f"The prompt fills the model's context ({cfg.n_ctx} tokens): shorten it to leave room to generate.")
        return None
    cols = st.columns(4)
    with cols[0]:
        mode = linked(st.radio, "Decoding", options=[GREEDY, SAMPLE], horizontal=True, key="generate_mode")
        top = min(MAX_NEW_TOKENS, room)
        new = linked(st.number_input, "New tokens", min_value=1, max_value=top, value=min(20, top), step=1,
                     key="generate_max_new_tokens")
    if mode == GREEDY:
        return Decoding(int(new))
    with cols[1]:
        temperature = linked(st.slider, "Temperature", min_value=0.05, max_value=2.0, value=1.0, step=0.05,
                             key="generate_temperature")
    with cols[2]:
        top_k = linked(st.number_input, "Top-k (0: all tokens)", min_value=0, max_value=cfg.d_vocab, value=50, step=1,
                       key="generate_top_k")
    with cols[3]:
        seed = linked(st.number_input, "Seed", min_value=0, max_value=2**31 - 1, value=0, step=1, key="generate_seed")
    return Decoding(int(new), float(temperature), int(top_k) or None, int(seed))


def _continuation_box(title: str, tokens: tuple[str, ...], start: Optional[int], key: str) -> None:
    st.markdown(f"**{title}**")
    with st.container(key=key, border=True):  # st.html: token text is never read as markdown or LaTeX
        st.html(f'<div style="white-space: pre-wrap">{highlighted_html(tokens, start)}</div>')


def _show(result: Continuations) -> None:
    where = result.first_divergence
    with st.container(key="generate_metrics"):
        cols = st.columns(3)
        cols[0].metric("First divergence", "none" if where is None else f"step {where}",
                       help="The first generated token where the two continuations differ (from 0)")
        cols[1].metric("Log-prob, clean", f"{sum(result.clean_logprobs):.3f}",
                       help="Sum of the clean model's log-prob of each token it chose")
        cols[2].metric("Log-prob, ablated", f"{sum(result.ablated_logprobs):.3f}",
                       help="Sum of the ablated model's log-prob of each token it chose")
    left, right = st.columns(2)
    with left:
        _continuation_box("Clean", result.clean_str_tokens, where, "generate_clean")
    with right:
        _continuation_box(f"Ablated ({result.method}: {', '.join(result.targets)})", result.ablated_str_tokens, where,
                          "generate_ablated")
    st.caption("Highlighted: from the first token where the continuations part. Log-probs are the model's own "
               "(temperature 1, before top-k), of the token it chose.")
    downloads.table(result.to_frame(), "generate_continuations", key="generate_table", height=300)


def main() -> None:
    st.title("Generate")
    loaded = require_model()
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    st.caption("The ablation below is the one chosen on the Ablation page: it follows you between pages and lives "
               "in the link.")
    targets = choose_targets(loaded)
    method = choose_method(targets)
    decoding = _decoding(loaded, prompt)
    if decoding is None:
        return
    if not targets:
        st.info("Choose at least one thing to ablate.")
        return
    # Mean and resample run without the KV cache and read the reference at every position generated.
    reference = reference_rows(loaded, prompt, method, length=len(prompt.ids) + decoding.max_new_tokens - 1)
    settings = (loaded.key, prompt.ids, targets, method, reference, astuple(decoding))
    if st.button("Generate", key="generate_run", type="primary"):
        st.session_state[_SHOWN] = settings
    if st.session_state.get(_SHOWN) != settings:
        st.info("Press Generate to continue the prompt, clean and ablated.")
        return
    _show(results.continuation(loaded, prompt.ids, targets, method, reference, *astuple(decoding)))


page_setup("Generate")
run_page(main)
