"""One model shared by many threads: calls that run it, hook it or cache it take turns.

Hook points, their hooks and their cache sinks are state on the model, so two threads running one model at
once would see each other's hooks and caches (thread B's logits with thread A's ablation, A's cache filled
with B's prompt). Every entry point that runs the model or attaches anything for the length of a call
(``model(...)``, ``hooks()`` and so ``run_with_hooks``, ``run_with_cache``) holds the model's lock for that
call. The lock is re-entrant, so a hook may run the model again, and a ``with model.hooks(...)`` block holds it
until it ends: another thread's forward waits rather than running under those hooks. Hooks added with
``add_hook`` stay on the model until ``reset_hooks`` by design, and every thread sees them.

The lock lives beside the model (a weak mapping), not in it, so a model can still be copied and pickled.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_LOCKS: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: Any) -> threading.RLock:
    """The re-entrant lock of ``model``'s calls (made on first use).

    Example:
        >>> with model_lock(model):   # a forward in another thread waits until the block ends
        ...     _ = model(tokens)
        >>> model_lock(model) is model_lock(model)
        True
    """
    lock = _LOCKS.get(model)
    if lock is None:
        with _LOCKS_GUARD:
            lock = _LOCKS.setdefault(model, threading.RLock())
    return lock
