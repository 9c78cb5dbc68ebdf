"""Which model the dashboard has open, and loading it once per process.

The choice lives in plain (non-widget) session-state keys so it survives moving between
pages; the model itself lives in ``st.cache_resource`` so every page and every browser tab
share one copy. Experiments add hooks to the shared model for the length of a call, so calls
on one model are serialised by its lock (two tabs must not see each other's hooks).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Optional

import streamlit as st
import torch

import workbench as wb

SOURCE_KEY = "model_source"  # a registered name or a path (HF dir, .gguf, saved dir)
IMPL_KEY = "attn_impl"
ATTN_IMPLS = ("sdpa", "eager", "flash")
LOAD_ERRORS = (wb.CheckpointError, wb.ConfigError, wb.InputError, FileNotFoundError, OSError)




def _leave_a_core_free() -> None:
    """Uses one intra-op thread fewer than there are cores, unless OMP_NUM_THREADS says otherwise.

    The Streamlit server (and often the browser) share the machine with the forward passes;
    when torch's spinning worker threads take every core, a 0.3 s forward pass on a 2-core
    machine was measured at 3-9 s. One core left free keeps the pages responsive.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))


_leave_a_core_free()


@dataclass(eq=False)
class LoadedModel:
    """A loaded model with the name it was loaded by (the cache key of every result) and its lock.

    Example:
        >>> loaded = LoadedModel(wb.Decoder(cfg), "toy-attn-2l|sdpa")   # doctest: +SKIP
        >>> with loaded.lock: loaded.model(tokens)                     # doctest: +SKIP
    """

    model: wb.Decoder
    key: str
    lock: threading.Lock = field(default_factory=threading.Lock)


def model_source() -> str:
    """The source of the open model (the default model until the user picks another).

    Example:
        >>> model_source()   # doctest: +SKIP
        'smollm2-135m'
    """
    if SOURCE_KEY not in st.session_state:
        st.session_state[SOURCE_KEY] = wb.default_model_name()
    return st.session_state[SOURCE_KEY]


def attn_impl() -> str:
    """The attention kernel the open model runs ("sdpa" unless the user picked another).

    Example:
        >>> attn_impl()   # doctest: +SKIP
        'sdpa'
    """
    return st.session_state.setdefault(IMPL_KEY, "sdpa")


def choose_model(source: str, impl: Optional[str] = None) -> None:
    """Makes ``source`` (and kernel ``impl``) the open model for every page of this session.

    Example:
        >>> choose_model("toy-moe-2l")   # doctest: +SKIP
    """
    st.session_state[SOURCE_KEY] = source.strip()
    if impl is not None:
        st.session_state[IMPL_KEY] = impl


@st.cache_resource(show_spinner=False, max_entries=3)
def _load(source: str, impl: str) -> LoadedModel:
    # Kept to three models: SmolLM2 in float32 is ~0.5 GiB and the machine may be small.
    model = wb.load_model(source, attn_impl=impl)
    return LoadedModel(model.eval(), f"{source}|{impl}")


def open_model() -> Optional[LoadedModel]:
    """The open model, or None after showing why it could not be loaded.

    Example:
        >>> loaded = open_model()   # doctest: +SKIP
        >>> loaded.model.cfg.n_layers if loaded else None   # doctest: +SKIP
    """
    source, impl = model_source(), attn_impl()
    if not source:
        st.error("No model chosen: pick a registered model or give a path on the Home page.")
        return None
    try:
        with st.spinner(f"Loading {source} …"):
            return _load(source, impl)
    except LOAD_ERRORS as error:
        st.error(f"Could not load model `{source}`: {error}")
        st.info("Pick another model on the Home page (registered names are listed there).")
        return None


def require_model() -> LoadedModel:
    """The open model; stops the page (after an explanation) when there is none.

    Example:
        >>> model = require_model().model   # doctest: +SKIP
    """
    loaded = open_model()
    if loaded is None:
        st.stop()
    return loaded
