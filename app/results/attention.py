"""The Attention and Heads pages' results: every head's pattern, per-head statistics and scores.

Legend: P position, S key position, H n_heads, L n_layers.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st
import torch

from app.results.long_runs import LongRun, ProgressBar
from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments import attention, heads


# Eight prompts' patterns: at the 256-token limit SmolLM2's are 70 MB each.
@st.cache_data(show_spinner="Computing attention patterns …", max_entries=8, hash_funcs=BY_MODEL_KEY)
def attention_patterns(loaded: LoadedModel, ids: tuple[int, ...]) -> torch.Tensor:
    """Every head's pattern on the prompt: [n_layers, n_heads, P, S].

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> patterns_LHPS = attention_patterns(loaded, tuple(tokens[0].tolist()))
        >>> patterns_LHPS.shape == (model.cfg.n_layers, model.cfg.n_heads, tokens.shape[1], tokens.shape[1])
        True
    """
    with loaded.lock:
        return attention.attention_patterns(loaded.model, torch.tensor([ids]))


# No spinner: a fast reduction of the patterns just drawn (the page showed none before it was cached).
@st.cache_data(show_spinner=False, max_entries=16, hash_funcs=BY_MODEL_KEY)
def head_summary(loaded: LoadedModel, ids: tuple[int, ...]) -> pd.DataFrame:
    """One row per (layer, head) of the prompt's patterns: entropy, attention to BOS, previous-token and
    duplicate-token share, mean distance (``experiments.attention.head_summary``).

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> summary = head_summary(loaded, tuple(tokens[0].tolist()))
        >>> len(summary) == model.cfg.n_layers * model.cfg.n_heads, list(summary.columns)
        (True, ['layer', 'head', 'entropy', 'bos_attention', 'prev_token_share', 'mean_distance',
                'duplicate_token_share'])
    """
    return attention.head_summary(attention_patterns(loaded, ids), torch.tensor([ids]))


def _head_scores(model, ids: tuple[int, ...], include_ablation: bool, progress, patterns_LHPS=None) -> pd.DataFrame:
    return heads.head_scores_table(model, torch.tensor([ids]), include_ablation=include_ablation, progress=progress,
                                   patterns_LHPS=patterns_LHPS)


_HEAD_SCORES = LongRun("Scoring heads", _head_scores)


def head_scores(loaded: LoadedModel, ids: tuple[int, ...], include_ablation: bool, bar: ProgressBar) -> pd.DataFrame:
    """Every head's induction, previous-token, duplicate-token and entropy score on the prompt, and (with
    ``include_ablation``) the loss change when it is zero-ablated; with a progress bar, kept in the long-run store.

    Example:
        >>> quiet = lambda text: ((lambda done, total: None), (lambda: None))
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> table = head_scores(loaded, tuple(tokens[0].tolist()), True, bar=quiet)
        >>> table.columns.tolist()
        ['layer', 'head', 'induction', 'previous_token', 'duplicate_token', 'entropy', 'ablation_delta']
    """
    if _HEAD_SCORES.is_stored(loaded, ids, include_ablation):
        return _HEAD_SCORES(loaded, ids, include_ablation, bar=bar)
    # Scored from the prompt's cached patterns (the Heads page draws two of them; the Attention page, all): one
    # forward pass fewer on a new prompt.
    return _HEAD_SCORES(loaded, ids, include_ablation, bar=bar, patterns_LHPS=attention_patterns(loaded, ids))
