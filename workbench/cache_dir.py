"""The workbench's one cache root on disk: ``$WORKBENCH_CACHE_DIR``, else ``~/.cache/workbench``.

Every disk cache lives in a folder of its own under it: the converted weights of a checkpoint
(``workbench.loading.weights_cache``, under ``weights/``) and the corpus-window scans
(``experiments.corpus_windows``, under ``neurons/``, ``features/`` ...). One function says where, so one
environment variable moves them all (the e2e tests point it at a temporary folder).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "WORKBENCH_CACHE_DIR"


def cache_directory() -> Path:
    """Where the workbench caches results on disk: ``$WORKBENCH_CACHE_DIR``, else ``~/.cache/workbench``.

    Example:
        >>> cache_directory().name in ("workbench",) or bool(os.environ.get("WORKBENCH_CACHE_DIR"))
        True
    """
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "workbench").expanduser()
