"""Cached experiment results shared by several pages, and the store for long runs with a progress bar.

Results are cached by ``st.cache_data`` on the model's key string (the model itself is passed
with a leading underscore, so Streamlit does not hash half a gigabyte of weights) and on the
token ids as a tuple.

Long runs (head sweep, induction scan, head score table) report progress to an ``st.progress``
bar. ``st.cache_data`` records every element call made inside a cached function and replays it
on a cache hit, which fails for a bar created outside the function; so these runs keep their
results in a small process-wide LRU store (``st.cache_resource``) and drive the bar themselves.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable

import streamlit as st
import torch

from app.state import LoadedModel
from app.widgets import progress_callback
from experiments import attention

_LONG_RUNS_KEPT = 32


# Eight prompts' patterns: at the 256-token limit SmolLM2's are 70 MB each.
@st.cache_data(show_spinner="Computing attention patterns …", max_entries=8)
def attention_patterns(_loaded: LoadedModel, model_key: str, ids: tuple[int, ...]) -> torch.Tensor:
    """Every head's pattern on the prompt: [n_layers, n_heads, q, k].

    Example:
        >>> patterns_LHQK = attention_patterns(loaded, loaded.key, prompt.ids)   # doctest: +SKIP
    """
    with _loaded.lock:
        return attention.attention_patterns(_loaded.model, torch.tensor([ids]))


@st.cache_resource(show_spinner=False)
def _long_run_store() -> tuple[OrderedDict, threading.Lock]:
    return OrderedDict(), threading.Lock()


def _run_key(loaded: LoadedModel, text: str, compute: Callable, args: tuple, kwargs: dict) -> tuple:
    return loaded.key, text, getattr(compute, "__qualname__", repr(compute)), args, tuple(sorted(kwargs.items()))


def with_progress(loaded: LoadedModel, text: str, compute: Callable[..., Any], *args: Hashable, **kwargs: Hashable) -> Any:
    """``compute(model, *args, progress=callback, **kwargs)`` with a progress bar, cached on the arguments.

    ``args`` and ``kwargs`` must be hashable (token ids as tuples); tensors are rebuilt by the caller's
    ``compute``. A repeated call returns the stored result without running or drawing anything.

    Example:
        >>> df = with_progress(loaded, "Sweeping heads", lambda m, ids, progress: head_sweep(
        ...     m, torch.tensor([ids]), progress=progress), prompt.ids)   # doctest: +SKIP
    """
    store, store_lock = _long_run_store()
    key = _run_key(loaded, text, compute, args, kwargs)
    with store_lock:
        if key in store:
            store.move_to_end(key)
            return store[key]
    report, finish = progress_callback(text)
    try:
        with loaded.lock:
            result = compute(loaded.model, *args, progress=report, **kwargs)
    finally:
        finish()
    with store_lock:
        store[key] = result
        while len(store) > _LONG_RUNS_KEPT:
            store.popitem(last=False)
    return result


def has_result(loaded: LoadedModel, text: str, compute: Callable[..., Any], *args: Hashable, **kwargs: Hashable) -> bool:
    """Whether ``with_progress`` with these arguments would return a stored result at once.

    Example:
        >>> has_result(loaded, "Sweeping heads", sweep, prompt.ids)   # doctest: +SKIP
        False
    """
    store, store_lock = _long_run_store()
    key = _run_key(loaded, text, compute, args, kwargs)
    with store_lock:
        return key in store
