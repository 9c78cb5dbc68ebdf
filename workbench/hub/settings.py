"""The Hub switches as the environment holds them when a call runs, not when ``huggingface_hub`` was imported.

``huggingface_hub`` reads ``HF_ENDPOINT``, ``HF_HUB_OFFLINE`` and the cache location once, at import; a notebook
or test that sets them later would be ignored. Every call here reads them afresh: the endpoint and the cache
are passed explicitly, and the library's offline flag is held at the environment's value for the duration of
one call (under a lock, so two calls never see each other's value).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

from huggingface_hub import constants

DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "on", "yes", "true"}
_switch_lock = threading.RLock()


def endpoint() -> str:
    """``HF_ENDPOINT`` as it is now (default https://huggingface.co), without a trailing slash.

    Example:
        >>> import os
        >>> endpoint() == (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
        True
    """
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set now, as huggingface_hub spells true.

    Example:
        >>> offline()   # the test suite runs offline
        True
    """
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def cache_dir(explicit: Optional[Union[str, Path]] = None) -> Path:
    """The HF hub cache: ``explicit``, else ``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``, ``HF_HOME``/hub,
    ``XDG_CACHE_HOME``/huggingface/hub or ~/.cache/huggingface/hub, as huggingface_hub resolves it.

    Example:
        >>> cache_dir("/tmp/my-cache")
        PosixPath('/tmp/my-cache')
    """
    if explicit is not None:
        return Path(explicit).expanduser()
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.path.expandvars(os.environ[variable])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


@contextmanager
def online_switch() -> Iterator[None]:
    """huggingface_hub's own offline flag held at the environment's current value for one call.

    Example:
        >>> with online_switch():
        ...     constants.HF_HUB_OFFLINE == offline()
        True
    """
    with _switch_lock:
        before = constants.HF_HUB_OFFLINE
        constants.HF_HUB_OFFLINE = offline()
        try:
            yield
        finally:
            constants.HF_HUB_OFFLINE = before
