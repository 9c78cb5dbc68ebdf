"""Keeping freed memory in the process: what makes caching every activation cheap on Linux CPUs.

A cached forward keeps every activation alive, so the heap grows by the cache's size on each call
and glibc hands those pages back to the kernel when the cache is dropped (it trims the heap above
128 KiB and serves large blocks with their own ``mmap``). The next call then takes a page fault,
and the kernel zeroes a page, for every 4 KiB of its cache: on SmolLM2-135M at 128 tokens that
was a third of ``run_with_cache``'s cost. ``keep_freed_memory`` tells glibc to serve large blocks
from the heap and keep freed memory for reuse (``mallopt`` M_MMAP_THRESHOLD and M_TRIM_THRESHOLD,
the knobs the ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` variables set). The price:
the process's resident memory stays at its peak instead of shrinking after a large cache is freed.
It is process-wide. The cacher (``workbench.hook_point.caching``, behind every ``run_with_cache``) applies it
the first time a process caches activations, so a user who caches gets it without knowing of it and a process
that never caches keeps glibc's defaults; ``WORKBENCH_KEEP_FREED_MEMORY=0`` in the environment turns the
automatic call off. Elsewhere than glibc it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

# glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
_LARGEST = 2**31 - 1  # mallopt takes an int; with M_MMAP_THRESHOLD glibc caps it at 32 MiB on 64-bit builds
OPT_OUT_VARIABLE = "WORKBENCH_KEEP_FREED_MEMORY"  # "0": caching leaves glibc's thresholds as they are
_caching_decided = threading.Event()  # set once the first cache of the process has made the choice


def keep_freed_memory() -> bool:
    """Keeps freed heap memory in the process for reuse (glibc): True when applied, False where unavailable.

    Call it once, before caching activations in a loop (a notebook, a sweep, the dashboard server);
    ``run_with_cache`` of every hook then stops paying a page fault per 4 KiB of its cache.

    Example:
        >>> import workbench as wb
        >>> wb.keep_freed_memory() in (True, False)
        True
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, _LARGEST)) and bool(mallopt(M_TRIM_THRESHOLD, _LARGEST))


def keep_freed_memory_for_caching() -> None:
    """What the cacher calls before it stores anything: ``keep_freed_memory()`` the first time in a process,
    unless ``WORKBENCH_KEEP_FREED_MEMORY=0``. Cheap after the first call (one flag read).

    The cost, stated: once a process has cached, its resident memory stays at the largest cache it held
    (freed blocks wait in the heap for the next cache instead of going back to the kernel).

    Example:
        >>> keep_freed_memory_for_caching(); _caching_decided.is_set()
        True
    """
    if _caching_decided.is_set():
        return
    if os.environ.get(OPT_OUT_VARIABLE, "1") != "0":
        keep_freed_memory()
    _caching_decided.set()


def readable_bytes(n_bytes: float) -> str:
    """A byte count in binary units, for messages and tables.

    Example:
        >>> readable_bytes(512), readable_bytes(1_461_456), readable_bytes(3 * 2**30)
        ('512 B', '1.4 MiB', '3.0 GiB')
    """
    value, unit = float(n_bytes), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
