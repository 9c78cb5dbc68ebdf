"""Turning checkpoints into ``Decoder``s: our own format, HF directories, GGUF files, registered names."""

from __future__ import annotations

from pathlib import Path
from typing import Union

import torch

from workbench.errors import CheckpointError
from workbench.loading.native import is_native_directory, load_native


def load_model(source: Union[str, Path], attn_impl: str = "sdpa", dtype: torch.dtype = torch.float32,
               device: str = "cpu"):
    """Loads a model from a registered name, an HF directory, a .gguf file or a saved directory.

    Example:
        >>> import workbench as wb
        >>> model = wb.load_model("runs/my-model", attn_impl="flash")   # doctest: +SKIP
    """
    path = Path(source)
    if is_native_directory(path):
        return load_native(path, attn_impl=attn_impl, dtype=dtype, device=device)
    raise CheckpointError(f"{source}: not a registered model name, HF directory, .gguf file or saved model")
