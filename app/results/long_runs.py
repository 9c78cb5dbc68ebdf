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


class HeldStore:
    """Results kept by reference for the whole process, the least recently used dropped past ``limit`` entries; every
    read and write under its lock (the dashboard's sessions run on threads).

    Example:
        >>> store = HeldStore(limit=2)
        >>> store.put("a", 1); store.put("b", 2); store.get("a"); store.put("c", 3)   # "b" was used least recently
        1
        >>> "b" in store, store.get("a"), store.get("b", "gone")
        (False, 1, 'gone')
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value held under ``key`` (now the most recently used), else ``default``."""
        with self._lock:
            if key not in self._items:
                return default
            self._items.move_to_end(key)
            return self._items[key]

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def put(self, key: Hashable, value: Any) -> None:
        """Holds ``value`` under ``key``, dropping the least recently used past the limit."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


@st.cache_resource(show_spinner=False)
def held_store(name: str, limit: int) -> HeldStore:
    """The process's one store called ``name`` (made on its first use): the long runs' here, the Logit lens page's
    runs in ``app.results.lens``.

    Example:
        >>> held_store("doctest store", 4) is held_store("doctest store", 4)
        True
    """
    return HeldStore(limit)


def _store() -> HeldStore:
    return held_store("long runs", RUNS_KEPT)


_MISSING = object()  # a stored result may be None


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
        key = self._key(loaded, args)
        stored = _store().get(key, _MISSING)
        if stored is not _MISSING:
            return stored
        report, finish = bar(self.text)
        try:
            with loaded.lock:
                result = self.compute(loaded.model, *args, progress=report, **unkeyed)
        finally:
            finish()
        _store().put(key, result)
        return result

    def is_stored(self, loaded: LoadedModel, *args: Hashable) -> bool:
        """Whether a call with these arguments would return a stored result at once (and draw no bar)."""
        return self._key(loaded, args) in _store()
