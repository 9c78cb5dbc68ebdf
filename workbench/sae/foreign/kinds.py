"""``ForeignKind``, one SAELens conversion kind, and the checked file readers the kinds share.

A kind reads files other libraries wrote; each reader here is bounded and refuses what it cannot trust: JSON by
size (``workbench.safe_files.read_json``), safetensors by header before data, ``.npz`` without pickles, ``.pt``
only through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from workbench.errors import CheckpointError
from workbench.safe_files import read_json

# A foreign config is a few kilobytes, as a cfg.json is.
MAX_CONFIG_BYTES = 16 * 2**20

# (repo folder of the SAE, the release's registry row, the SAE's registry entry) -> the repo file names to fetch.
FilesOf = Callable[[str, Mapping[str, Any], Mapping[str, Any]], list[str]]
# (local paths by repo file name, the release row, the SAE entry) -> (a SAELens cfg.json as a dict, SAELens tensors).
Convert = Callable[[Mapping[str, Path], Mapping[str, Any], Mapping[str, Any]], tuple[dict[str, Any], dict[str, Tensor]]]


@dataclass(frozen=True)
class ForeignKind:
    """One SAELens conversion kind: its ``name`` (SAELens's key), the ``files`` it reads, the ``optional`` ones it reads
    where the repo has them, and how it ``convert``s them (``paths`` holds an optional file only when it exists).

    Example:
        >>> kind = ForeignKind("example", lambda folder, row, entry: [f"{folder}/params.npz"], lambda paths, row, entry: ({}, {}))
        >>> kind.files("layer_0", {}, {})
        ['layer_0/params.npz']
    """

    name: str
    files: FilesOf
    convert: Convert
    optional: FilesOf = lambda folder, row, entry: []  # files read when the repo has them (absent is no error)


def read_config(path: Path) -> dict[str, Any]:
    """A foreign JSON config as a dict (bounded; not a JSON object is a ``CheckpointError`` naming the file).

    Example:
        >>> read_config(Path("no/hyperparams.json"))
        Traceback (most recent call last):
        workbench.errors.CheckpointError: no/hyperparams.json: ...
    """
    raw = read_json(path, MAX_CONFIG_BYTES, what="an SAE config")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: an SAE config is a JSON object, got {type(raw).__name__}")
    return raw


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of a safetensors file (an unreadable file is a ``CheckpointError`` naming it).

    Example:
        >>> read_safetensors(Path("no/final.safetensors"))
        Traceback (most recent call last):
        workbench.errors.CheckpointError: no/final.safetensors: not a readable safetensors file ...
    """
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None


def read_npz(path: Path) -> dict[str, Tensor]:
    """Every array of an ``.npz`` file as a tensor, pickled objects refused (``allow_pickle=False``).

    Example:
        >>> read_npz(Path("no/params.npz"))
        Traceback (most recent call last):
        workbench.errors.CheckpointError: no/params.npz: not a readable .npz file ...
    """
    try:
        with np.load(str(path), allow_pickle=False) as arrays:
            return {name: torch.from_numpy(np.array(arrays[name])) for name in arrays.files}
    except (OSError, ValueError, EOFError, TypeError) as error:  # TypeError: an array of strings or objects
        raise CheckpointError(f"{path}: not a readable .npz file ({error})") from None


def read_torch(path: Path) -> dict[str, Any]:
    """A ``.pt`` file read by ``torch.load(weights_only=True)`` only (tensors, numbers, strings, containers).

    Example:
        >>> read_torch(Path("no/ae.pt"))
        Traceback (most recent call last):
        workbench.errors.CheckpointError: no/ae.pt: not a readable weights-only torch file ...
    """
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch raises many types for a bad or unsafe pickle
        raise CheckpointError(f"{path}: not a readable weights-only torch file ({type(error).__name__}: "
                              f"{str(error)[:300]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, got {type(state).__name__}")
    return state
