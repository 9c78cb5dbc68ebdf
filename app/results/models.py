"""The loaded models, one copy per process, and how every cached result names its model.

Results are cached on the model's key string, never on the model: ``BY_MODEL_KEY`` is the
``hash_funcs`` every ``st.cache_data`` in this package passes, so Streamlit never hashes half a
gigabyte of weights.
"""

from __future__ import annotations

import streamlit as st

import workbench as wb
from app.state import LoadedModel

BY_MODEL_KEY = {LoadedModel: lambda loaded: loaded.key}


# Kept to three models: SmolLM2 in float32 is ~0.5 GiB and the machine may be small.
@st.cache_resource(show_spinner=False, max_entries=3)
def load_model(source: str, impl: str) -> LoadedModel:
    """The model at ``source`` (a registered name or a path) running kernel ``impl``, loaded once per process.

    Example:
        >>> loaded = load_model("toy-attn-2l", "eager")
        >>> loaded.key, loaded.model.cfg.n_layers
        ('toy-attn-2l|eager', 2)
        >>> load_model("toy-attn-2l", "eager") is loaded   # the same copy for every page and tab
        True
    """
    model = wb.load_model(source, attn_impl=impl)
    return LoadedModel(model.eval(), f"{source}|{impl}")
