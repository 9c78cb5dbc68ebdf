"""Process-wide settings the dashboard applies once when it starts (from ``page_setup``), never on import.

Importing an app module must leave the process as it was (tests and the experiment commands
import them too); only a running dashboard page changes torch's thread count or the garbage collector.
"""

from __future__ import annotations

import functools
import gc
import os

import torch


@functools.cache  # once per process: a later explicit torch.set_num_threads is not undone on the next page
def leave_a_core_free() -> None:
    """Uses one intra-op thread fewer than there are cores, unless OMP_NUM_THREADS says otherwise.

    The Streamlit server (and often the browser) share the machine with the forward passes;
    when torch's spinning worker threads take every core, a 0.3 s forward pass on a 2-core
    machine was measured at 3-9 s. One core left free keeps the pages responsive.

    Example (it changes torch's threads for the whole process, once):
        >>> leave_a_core_free()   # doctest: +SKIP
        >>> torch.get_num_threads() == max(1, (os.cpu_count() or 1) - 1)   # doctest: +SKIP
        True
    """
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))


def readout_workers() -> int:
    """Threads for a read of many rows through the vocabulary (the Logit lens grid): one per share of the cores
    torch's thread count leaves, so the core ``leave_a_core_free`` keeps for the browser joins in.

    While the server reads the grid the browser has drawn the page's first elements and waits for the figure: on the
    2-core machine that core sat idle (a Chromium trace of 64-token prompt changes on SmolLM2), and two workers
    read the 496-row grid in 0.08 s against 0.16 s.

    Example:
        >>> readout_workers() == max(1, (os.cpu_count() or 1) // torch.get_num_threads())
        True
    """
    return max(1, (os.cpu_count() or 1) // max(torch.get_num_threads(), 1))


@functools.cache  # once per name: what was imported or loaded by then stays for the process's life
def freeze_long_lived(name: str) -> None:
    """Moves every object the process holds now out of the garbage collector's reach (``gc.freeze``), once per
    ``name`` (a page's first run).

    Streamlit collects every generation after each script run (``runner.postScriptGC``); with torch, plotly,
    pandas and a model's modules in memory that pass took 0.18-0.24 s on SmolLM2-135M, a quarter of a prompt
    change, and it holds the GIL while the last figures wait to be sent. Frozen, the objects of imports and
    the page's first run are no longer scanned; each run's own garbage is still collected. Frozen objects that
    later become cyclic garbage are never freed: bounded, as it happens once per page. A model the cache lets go
    is still freed: its modules hold no reference cycles (reference counting frees it, checked on SmolLM2-135M).

    Example (it changes the collector for the whole process, once per name):
        >>> freeze_long_lived("page Attention")   # doctest: +SKIP
        >>> gc.get_freeze_count() > 0   # doctest: +SKIP
        True
    """
    gc.freeze()
