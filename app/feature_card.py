"""The feature card the Features and Attribution graph pages share: a feature's activation on the prompt, its
direct effect on the logits, and its top-activating corpus windows and density (``app.results.features``).

Every widget key starts with the page's ``prefix`` (``features``, ``attribution``), so each page keeps its own
settings in the URL.
"""

from __future__ import annotations

from typing import Optional

import streamlit as st

from app import downloads, results
from app.results.features import CORPUS_WINDOW_COUNTS, LoadedSAE
from app.safe_text import quoted
from app.state import LoadedModel
from app.token_widgets import token_text
from app.url_state import linked
from app.widgets import Prompt, progress_callback
from experiments.corpus_windows import CORPUS_LABELS, CORPUS_SOURCES, default_corpus
from experiments.plots.features import density_figure
from experiments.plots.token_view import token_html
from experiments._depth import hook_layer
from workbench.errors import InputError

TOP_K = 10
WINDOW_LENGTHS = (32, 64, 128)
LATE_FRACTION = 0.75  # features writing at or after this share of the layers are read without the caveat


def mid_layer_caveat(model, hook_name: str) -> Optional[str]:
    """The caveat a feature's direct logit effect carries when it writes at ``hook_name`` before the last quarter of
    ``model``'s layers (None from there on): the later layers read and transform what it writes, so the tokens its
    decoder direction projects onto through the unembedding are weak evidence of what it does to the prediction.

    Example:
        >>> mid_layer_caveat(model, "blocks.0.hook_mlp_out")[:45]
        'Layer 0 of 2 writes this feature: its direct '
        >>> mid_layer_caveat(model, "blocks.1.hook_resid_post") is None
        True
    """
    layer = hook_layer(model, hook_name)
    n_layers = model.cfg.n_layers
    if layer + 1 > LATE_FRACTION * n_layers or layer >= n_layers - 1:
        return None
    return (f"Layer {layer} of {n_layers} writes this feature: its direct effect on the logits is weak evidence of "
            f"what it does, since the {n_layers - 1 - layer} later layers read and transform what it writes before "
            "the unembedding (the attribution graph's edges, or an intervention, show its effect through them).")


def on_prompt(loaded: LoadedModel, loaded_sae: LoadedSAE, prompt: Prompt, feature: int, prefix: str) -> None:
    """The feature's activation on each token of the prompt: its peak, where it fires, the prompt coloured."""
    acts = results.feature_on_prompt(loaded, loaded_sae, prompt.ids, feature)
    peak = acts.loc[acts["activation"].idxmax()]
    with st.container(key=f"{prefix}_metrics", horizontal=True):
        st.metric("Max activation on the prompt", f"{peak['activation']:.4f}")
        st.metric("At token", f"{int(peak['position'])}: {peak['token']!r}")
        st.metric("Tokens where it fires", f"{int((acts['activation'] > 0).sum())} of {len(acts)}")
    token_text(token_html(prompt.str_tokens, acts["activation"], selected=int(peak["position"]), value_name="activation"),
               f"feature_{feature}", key=f"{prefix}_prompt", title=f"Feature {feature}")


def logit_effect(loaded: LoadedModel, loaded_sae: LoadedSAE, feature: int, prefix: str) -> None:
    """The tokens the feature's decoder direction promotes and suppresses directly."""
    st.subheader("Direct effect on the logits")
    through_norm = linked(st.toggle, "Through the final norm's gain", value=True, key=f"{prefix}_norm_gain")
    try:
        effect = results.feature_logit_effect(loaded, loaded_sae, feature, TOP_K, through_norm)
    except InputError as error:  # an SAE writing something other than the residual stream
        st.info(f"No direct logit effect: {quoted(error, limit=300)}")
        return
    caveat = mid_layer_caveat(loaded.model, loaded_sae.sae.cfg.hook_name_out or loaded_sae.sae.cfg.hook_name)
    if caveat is not None:
        st.warning(caveat, icon=":material/info:")
    st.caption(f"W_dec[{feature}] (through W_O for an SAE on hook_z) {'times the final norm gain ' if through_norm else ''}"
               "projected on the unembedding W_U: what one unit of the feature adds to each token's logit directly.")
    left, right = st.columns(2)
    for column, direction in ((left, "promoted"), (right, "suppressed")):
        with column:
            st.markdown(f"**{direction.capitalize()}**")
            downloads.table(effect[effect["direction"] == direction].drop(columns="direction"),
                            f"feature_{feature}_{direction}", key=f"{prefix}_{direction}")


def corpus(loaded: LoadedModel, loaded_sae: LoadedSAE, feature: int, prefix: str) -> None:
    """The feature's top-activating corpus windows and its density."""
    st.subheader("Top-activating windows and density in the corpus")
    left, text, middle, right = st.columns(4)
    with left:
        search = linked(st.toggle, "Search the corpus", value=True, key=f"{prefix}_corpus",
                        help="Computed once for every feature of this SAE, then read from the disk cache.")
    with text:
        corpus = linked(st.selectbox, "Corpus", options=list(CORPUS_LABELS), format_func=CORPUS_LABELS.get,
                        index=list(CORPUS_LABELS).index(default_corpus(loaded.model)), key=f"{prefix}_corpus_text",
                        help="The text scanned: by default the one the model was trained on.")
    with middle:
        # one of the bounded corpus sizes: a pass, and the cache file it writes, is one of a fixed few per SAE
        n_windows = linked(st.selectbox, "Windows", options=CORPUS_WINDOW_COUNTS,
                           index=CORPUS_WINDOW_COUNTS.index(256), key=f"{prefix}_windows")
    lengths = [w for w in WINDOW_LENGTHS if w <= loaded.model.cfg.n_ctx] or [loaded.model.cfg.n_ctx]
    with right:
        window = linked(st.selectbox, "Tokens per window", options=lengths, index=min(1, len(lengths) - 1),
                        key=f"{prefix}_window_len")
    if not search:
        return
    stats = results.feature_corpus_stats(loaded, loaded_sae, int(n_windows), int(window), bar=progress_callback,
                                         corpus=corpus)
    where = f"read from {stats.path}" if stats.from_disk else (f"saved to {stats.path}" if stats.path else "")
    density = float(stats.density_X[feature])
    st.metric("Density", f"{density:.3%}", help=f"The fraction of the corpus's {stats.n_tokens} tokens where "
                                                 "the feature fires")
    st.caption(f"{stats.windows_BP.shape[0]} windows of {window} tokens from evenly spaced {CORPUS_SOURCES[corpus]}, "
               "BOS left out; "
               f"every feature at once, {quoted(where, limit=300)}.")
    table, html = results.feature_top_windows(loaded, stats, feature, TOP_K)
    if table.empty:
        st.info(f"Feature {feature} never fires on this corpus (a dead feature here).")
    else:
        token_text(html, f"feature_{feature}_top_windows", key=f"{prefix}_top_windows",
                   title=f"Feature {feature}: top windows")
        downloads.table(table, f"feature_{feature}_top_windows", key=f"{prefix}_top_windows_table", height=250)
    fig = density_figure(results.feature_density(stats, feature), f"Feature {feature}: activation density")
    downloads.figure(fig, f"feature_{feature}_density", key=f"{prefix}_density")
