"""The Induction page's results: every head's induction score on repeated random tokens, and the loss
on each copy.

Legend: H n_heads, L n_layers.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st
import torch

from app.results.long_runs import LongRun, ProgressBar
from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments import induction


def _induction_scores(model, seq_len: int, batch: int, seed: int, progress) -> torch.Tensor:
    return induction.induction_scores(model, seq_len=seq_len, batch=batch, seed=seed, progress=progress)


_INDUCTION_SCORES = LongRun("Scanning layers", _induction_scores)


def induction_scores(loaded: LoadedModel, seq_len: int, batch: int, seed: int, bar: ProgressBar) -> torch.Tensor:
    """Every head's induction score [n_layers, n_heads] on ``batch`` sequences of ``seq_len`` random tokens
    repeated twice, with a progress bar (one step per layer), kept in the long-run store.

    Example:
        >>> quiet = lambda text: ((lambda done, total: None), (lambda: None))
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> induction_scores(loaded, seq_len=8, batch=2, seed=0, bar=quiet).shape
        torch.Size([2, 4])
    """
    return _INDUCTION_SCORES(loaded, seq_len, batch, seed, bar=bar)


@st.cache_data(show_spinner="Measuring the loss on both copies …", max_entries=16, hash_funcs=BY_MODEL_KEY)
def induction_loss(loaded: LoadedModel, seq_len: int, batch: int, seed: int) -> pd.DataFrame:
    """The per-position loss on the first and second copy of ``batch`` repeated random sequences (averaged
    over the batch).

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> loss = induction_loss(loaded, seq_len=8, batch=2, seed=0)
        >>> loss.groupby("copy")["loss"].count().to_dict()   # 8 positions per copy
        {'first': 8, 'second': 8}
    """
    with loaded.lock:
        return induction.induction_loss(loaded.model, seq_len=seq_len, batch=batch, seed=seed)
