"""Which model the dashboard has open: the session's choice, and the type of a loaded model.

The choice lives in plain (non-widget) session-state keys so it survives moving between
pages. Loading the model is the cache layer's job (``app.results.load_model``); showing why a
model could not be opened is the widgets' (``app.widgets.require_model``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import streamlit as st

import workbench as wb

SOURCE_KEY = "model_source"  # a registered name or a path (HF dir, .gguf, saved dir)
IMPL_KEY = "attn_impl"
OFFER_KEY = "linked_model_offer"  # a path or Hub repo id named by a link, waiting for the user's click
FAILURE_KEY = "model_load_failure"  # ((source, kernel), message) of the last load that failed in this session
DEFAULT_IMPL = "sdpa"
# The model's kernels (``workbench.ATTN_IMPLS``), the default first: the order the Home page offers them in.
ATTN_IMPLS = (DEFAULT_IMPL, *(impl for impl in wb.ATTN_IMPLS if impl != DEFAULT_IMPL))


@dataclass(eq=False)
class LoadedModel:
    """A loaded model with the name it was loaded by (the cache key of every result) and its lock.

    Experiments add hooks to the shared model for the length of a call, so calls on one model
    are serialised by its lock (two tabs must not see each other's hooks).

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> with loaded.lock:
        ...     logits = loaded.model(tokens)
        >>> logits.shape == (1, tokens.shape[1], model.cfg.d_vocab)
        True
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
    return st.session_state.setdefault(IMPL_KEY, DEFAULT_IMPL)


def open_linked_model() -> None:
    """Opens the registered model a link names (``?model=...&impl=...``) when this session has not chosen one yet.

    Called by every page before anything else, so a copied link reopens its model on any page. A link
    naming anything else (a path on the server, a Hub repo id) opens nothing: it is kept as an offer
    (``linked_model_offer``) that the page shows with a button, so only a click loads a file a link
    names or downloads (``app.hub_picker``), and a path that fails is not tried again on every rerun.

    Example:
        >>> open_linked_model()   # doctest: +SKIP
    """
    if SOURCE_KEY in st.session_state:
        return
    source, impl = st.query_params.get("model"), st.query_params.get("impl")
    impl = impl if impl in ATTN_IMPLS else None
    if not source or not source.strip():
        return
    if source.strip() in wb.list_models()["name"].tolist():
        choose_model(source, impl)
    else:
        st.session_state[OFFER_KEY] = (source.strip(), impl)


def linked_model_offer() -> Optional[tuple[str, Optional[str]]]:
    """The (path or Hub repo id, kernel) a link offered and the user has neither opened nor replaced, else None.

    Example:
        >>> linked_model_offer()   # doctest: +SKIP
        ('/data/my-model', 'eager')
    """
    return st.session_state.get(OFFER_KEY)


def choose_model(source: str, impl: Optional[str] = None) -> None:
    """Makes ``source`` (and kernel ``impl``) the open model for every page of this session.

    Example:
        >>> choose_model("toy-moe-2l")   # doctest: +SKIP
    """
    st.session_state[SOURCE_KEY] = source.strip()
    st.session_state.pop(OFFER_KEY, None)  # a model chosen by hand replaces a link's offer
    forget_load_failure()  # a choice made again is tried again
    if impl is not None:
        st.session_state[IMPL_KEY] = impl


def record_load_failure(source: str, impl: str, message: str) -> None:
    """Remembers that ``source`` with kernel ``impl`` failed to load, and why: the pages show ``message``
    instead of loading it again on every rerun (a slow or broken file would be re-read at each click).

    Example:
        >>> record_load_failure("smollm2-135m", "sdpa", "weights file not found")   # doctest: +SKIP
    """
    st.session_state[FAILURE_KEY] = ((source, impl), message)


def load_failure(source: str, impl: str) -> Optional[str]:
    """Why ``source`` with kernel ``impl`` failed to load in this session, or None if it has not failed.

    Example:
        >>> load_failure("smollm2-135m", "sdpa")   # doctest: +SKIP
        'weights file not found'
    """
    failure = st.session_state.get(FAILURE_KEY)
    return failure[1] if failure is not None and failure[0] == (source, impl) else None


def forget_load_failure() -> None:
    """Lets the next page run try the chosen model again.

    Example:
        >>> forget_load_failure()   # doctest: +SKIP
    """
    st.session_state.pop(FAILURE_KEY, None)
