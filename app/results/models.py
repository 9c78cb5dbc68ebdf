"""The loaded models, one copy per process (the default one warmed in the background on the first run), and how
every cached result names its model.

Results are cached on the model's key string, never on the model: ``BY_MODEL_KEY`` is the
``hash_funcs`` every ``st.cache_data`` in this package passes, so Streamlit never hashes half a
gigabyte of weights.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import streamlit as st

import workbench as wb
from app.state import LoadedModel

BY_MODEL_KEY = {LoadedModel: lambda loaded: loaded.key}
log = logging.getLogger(__name__)


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


_WARMING: dict[tuple[str, str], threading.Thread] = {}  # the warm-up thread per model, started once per process
_WARM_FAILURES: dict[tuple[str, str], str] = {}  # why a warm-up load failed, for the page to show
_WARMING_LOCK = threading.Lock()


def warm_model(source: str, impl: str) -> threading.Thread:
    """Starts loading ``source`` with kernel ``impl`` into ``load_model``'s cache in a background thread, once per
    process, and returns that thread; the page's own ``load_model`` call then waits for the same load (Streamlit
    computes one cached value once, whoever asks) instead of starting a second one.

    The dashboard calls it for the default model on its first run, so the model is loading while the first page
    draws its controls. A failure is kept (``warm_failure``) and logged, never lost: the page's own load raises it
    again and shows it.

    Example:
        >>> warm_model("toy-attn-2l", "eager").join()
        >>> warm_model("toy-attn-2l", "eager") is warm_model("toy-attn-2l", "eager")   # started once
        True
        >>> warm_failure("toy-attn-2l", "eager") is None, load_model("toy-attn-2l", "eager").key
        (True, 'toy-attn-2l|eager')
    """
    with _WARMING_LOCK:
        thread = _WARMING.get((source, impl))
        if thread is None:
            thread = threading.Thread(target=_warm, args=(source, impl), name=f"warm {source}", daemon=True)
            _WARMING[(source, impl)] = thread
            thread.start()
    return thread


def _warm(source: str, impl: str) -> None:
    try:
        load_model(source, impl)
    except Exception as error:  # noqa: BLE001 - kept for the page; the page's own load shows it
        log.warning("warming %s (%s) failed: %s", source, impl, error)
        _WARM_FAILURES[(source, impl)] = f"{type(error).__name__}: {error}"


def warm_failure(source: str, impl: str) -> Optional[str]:
    """Why the background load of ``warm_model(source, impl)`` failed, or None (not started, running or loaded).

    Example:
        >>> warm_model("/no/such/model", "sdpa").join()
        >>> "no/such/model" in warm_failure("/no/such/model", "sdpa")
        True
    """
    return _WARM_FAILURES.get((source, impl))
