"""What every loader shares: when to show a progress bar, and how to refuse a value.

One place for both, so a GGUF file and an HF directory behave and report alike.
"""

from __future__ import annotations

from typing import Any, Optional

from workbench.errors import ConfigError

# Above this many bytes of weights a progress bar is shown unless the caller says otherwise.
PROGRESS_THRESHOLD_BYTES = 64 * 2**20


def show_progress(n_bytes: int, progress: Optional[bool]) -> bool:
    """The caller's choice, or (``progress=None``) a bar only for checkpoints over 64 MiB.

    Example:
        >>> show_progress(2**30, None), show_progress(2**30, False), show_progress(10, None)
        (True, False, False)
    """
    return n_bytes > PROGRESS_THRESHOLD_BYTES if progress is None else progress


def cannot_honour(source: str, field: str, value: Any, why: str) -> ConfigError:
    """The error for a checkpoint value we cannot honour (returned, so callers ``raise`` it visibly).

    Example:
        >>> str(cannot_honour("ckpt/config.json", "rope_scaling", "yarn", "only unscaled RoPE"))
        "ckpt/config.json: field 'rope_scaling' = 'yarn' cannot be honoured: only unscaled RoPE"
    """
    return ConfigError(f"{source}: field '{field}' = {value!r} cannot be honoured: {why}")
