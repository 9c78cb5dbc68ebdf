"""What every loader shares: when to show a progress bar, how to refuse a value, and how to check a
declared layer count against the tensors a file holds.

One place for each, so a GGUF file, an HF directory and our own format behave and report alike.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional

from workbench.errors import CheckpointError, ConfigError

# A layer's tensors in every naming we read: ours (blocks.3.), transformers' (model.layers.3.,
# transformer.h.3.) and llama.cpp's (blk.3.).
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:blocks|layers|h|blk)\.(\d+)\.")

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


def check_layer_count(n_layers: int, tensor_names: Iterable[str], source: str, field: str) -> None:
    """Refuses a config that declares more layers than its file's tensors hold, from the tensor names
    alone (a file header): a hostile layer count is refused before a block is built or a layer read.

    Example:
        >>> check_layer_count(2, ["embed.W_E", "blocks.0.attn._W_Q_lin", "blocks.1.attn._W_Q_lin"], "m", "n_layers")
        >>> check_layer_count(100000, ["model.layers.0.mlp.up_proj.weight"], "ckpt/config.json", "num_hidden_layers")
        Traceback (most recent call last):
        ...
        workbench.errors.CheckpointError: ckpt/config.json: field 'num_hidden_layers' declares 100000 layers, but the weights hold tensors for 1
    """
    present = {int(match.group(1)) for name in tensor_names if (match := _LAYER_INDEX.search(name))}
    if n_layers > len(present):
        raise CheckpointError(f"{source}: field '{field}' declares {n_layers} layers, but the weights hold "
                              f"tensors for {len(present)}")
