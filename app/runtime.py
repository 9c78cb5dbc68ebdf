"""Process-wide settings the dashboard applies once when it starts (from ``page_setup``), never on import.

Importing an app module must leave the process as it was (tests and the experiment commands
import them too); only a running dashboard page changes torch's thread count.
"""

from __future__ import annotations

import functools
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
