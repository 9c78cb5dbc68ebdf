"""The process-wide store for long runs that report to a progress bar (head scores, head sweep,
induction scan, exact patching, corpus maxima, information flow).

``st.cache_data`` records every element call made inside a cached function and replays it on a
cache hit, which fails for a bar created outside the function; so these runs keep their results
in a small process-wide LRU store (``st.cache_resource``) and drive the bar themselves. The bar
comes from the caller (``app.widgets.progress_callback``): this layer draws nothing of its own.

A result is stored under the model's key, the run's text (unique to each ``LongRun``) and the
run's arguments (hashable: token ids as tuples).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import streamlit as st

from app.state import LoadedModel

# ``(text) -> (report(done, total), finish())``: draws a progress bar and removes it.
ProgressBar = Callable[[str], tuple[Callable[[int, int], None], Callable[[], None]]]
RUNS_KEPT = 32


def no_bar(text: str) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """A ``ProgressBar`` that draws nothing: for a run recomputed inside a cached function, which must not draw.

    Example:
        >>> report, finish = no_bar("Scoring")
        >>> report(1, 2), finish()
        (None, None)
    """
    return (lambda done, total: None), (lambda: None)


@st.cache_resource(show_spinner=False)
def _store() -> tuple[OrderedDict, threading.Lock]:
    return OrderedDict(), threading.Lock()


@dataclass(frozen=True)
class LongRun:
    """A long computation, ``compute(model, *args, progress=report)``, run under the model's lock with
    a progress bar titled ``text`` and kept in the store; a repeated call returns the stored result
    without running or drawing anything.

    Example:
        >>> drawn = []
        >>> def bar(text):
        ...     drawn.append(text)
        ...     return (lambda done, total: None), (lambda: None)
        >>> double = LongRun("Doubling (doctest)", lambda model, x, progress: 2 * x)
        >>> loaded = LoadedModel(model, "toy-attn-2l|doctest")
        >>> double(loaded, 21, bar=bar), double(loaded, 21, bar=bar), drawn   # the bar is drawn once
        (42, 42, ['Doubling (doctest)'])
        >>> double.is_stored(loaded, 21), double.is_stored(loaded, 20)
        (True, False)
    """

    text: str  # the progress bar's text, and the run's name in the store
    compute: Callable[..., Any]

    def _key(self, loaded: LoadedModel, args: tuple[Hashable, ...]) -> tuple:
        return loaded.key, self.text, args

    def __call__(self, loaded: LoadedModel, *args: Hashable, bar: ProgressBar, **unkeyed: Any) -> Any:
        """The stored result, or ``compute`` run with ``bar(text)``'s progress bar (then stored).

        ``unkeyed``: inputs that follow from ``args`` (the prompt's cached patterns), handed to ``compute`` as
        keywords and left out of the store's key."""
        store, store_lock = _store()
        key = self._key(loaded, args)
        with store_lock:
            if key in store:
                store.move_to_end(key)
                return store[key]
        report, finish = bar(self.text)
        try:
            with loaded.lock:
                result = self.compute(loaded.model, *args, progress=report, **unkeyed)
        finally:
            finish()
        with store_lock:
            store[key] = result
            while len(store) > RUNS_KEPT:
                store.popitem(last=False)
        return result

    def is_stored(self, loaded: LoadedModel, *args: Hashable) -> bool:
        """Whether a call with these arguments would return a stored result at once (and draw no bar)."""
        store, store_lock = _store()
        with store_lock:
            return self._key(loaded, args) in store
