"""The Logit lens page's results: what each layer's residual stream predicts, and each component's
direct contribution to one logit.
"""

from __future__ import annotations

from typing import Optional

import pandas as pd
import streamlit as st
import torch

from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments import lens


@st.cache_data(show_spinner="Reading every layer through the unembedding …", max_entries=16, hash_funcs=BY_MODEL_KEY)
def logit_lens(loaded: LoadedModel, ids: tuple[int, ...], top_k: int) -> pd.DataFrame:
    """The top ``top_k`` tokens each layer's residual stream predicts at each position.

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> table = logit_lens(loaded, tuple(tokens[0].tolist()), top_k=3)
        >>> sorted(table["rank"].unique().tolist())
        [1, 2, 3]
    """
    with loaded.lock:
        return lens.logit_lens(loaded.model, torch.tensor([ids]), top_k=top_k)


@st.cache_data(show_spinner="Attributing the logit …", max_entries=32, hash_funcs=BY_MODEL_KEY)
def direct_logit_attribution(loaded: LoadedModel, ids: tuple[int, ...], target: int, baseline: Optional[int],
                             position: int) -> pd.DataFrame:
    """Each component's direct contribution to the logit of ``target`` (minus ``baseline``) at ``position``.

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> dla = direct_logit_attribution(loaded, tuple(tokens[0].tolist()), 262, None, position=-1)
        >>> bool(abs(dla["attribution"].sum() - dla.attrs["logit_diff"]) < 1e-3)   # the parts sum to the logit
        True
    """
    with loaded.lock:
        return lens.direct_logit_attribution(loaded.model, torch.tensor([ids]), target, baseline, position)
