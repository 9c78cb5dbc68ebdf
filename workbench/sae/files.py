"""``load_sae``: an SAE from a SAELens directory (``cfg.json`` and ``sae_weights.safetensors``).

It reads SAELens 6 and earlier configs (``workbench.sae.config``) and checks every tensor
(``workbench.sae.tensors``) before building anything. Writing is ``workbench.sae.format``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError, safe_open

from workbench.errors import CheckpointError, ConfigError
from workbench.sae.config import DTYPES, config_from_dict
from workbench.safe_files import inside
from workbench.sae.format import CFG_FILE, WEIGHTS_FILE
from workbench.sae.model import SAE
from workbench.sae.shipped import shipped_path
from workbench.sae.tensors import check_tensors


def load_sae(path: Union[str, Path], device: Any = None, dtype: Any = None) -> SAE:
    """The SAE saved in SAELens directory ``path`` (or shipped under that name: ``shipped_saes()``), on ``device`` (default CPU, as SAELens's ``load_from_disk``)
    in ``dtype`` (default the config's). A missing, unreadable, mis-shaped or non-finite file or tensor is a
    ``CheckpointError`` naming it; a config value we cannot honour a ``ConfigError`` naming the field.

    Example:
        >>> wb.load_sae("no/such/sae")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: no/such/sae: no such directory (an SAE is a directory with cfg.json and sae_weights.safetensors)
    """
    folder = Path(path)
    if not folder.is_dir() and shipped_path(path) is not None:
        folder = shipped_path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{path}: no such directory (an SAE is a directory with {CFG_FILE} and {WEIGHTS_FILE})")
    cfg_path = inside(folder, CFG_FILE, must_exist=True, what="SAE directory")
    weights_path = inside(folder, WEIGHTS_FILE, must_exist=True, what="SAE directory")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{cfg_path}: not a readable JSON file ({error})") from None
    dtype_name = _dtype_name(dtype)
    try:
        cfg = config_from_dict(raw, dtype=dtype_name, device=str(torch.device(device)) if device is not None else "cpu")
    except ConfigError as error:
        raise ConfigError(f"{cfg_path}: {error}") from None
    tensors = _read_tensors(weights_path)
    check_tensors(cfg, tensors, str(weights_path), CheckpointError)
    return SAE.from_tensors(cfg, {name: tensor.to(cfg.torch_dtype) for name, tensor in tensors.items()})


def _read_tensors(weights_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file, with SAELens's handling of a pre-6.0 ``scaling_factor`` (all ones: dropped)."""
    try:
        with safe_open(str(weights_path), framework="pt") as file:
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{weights_path}: not a readable safetensors file ({error})") from None
    scale = tensors.pop("scaling_factor", None)
    if scale is not None and not torch.allclose(scale.float(), torch.ones_like(scale, dtype=torch.float32)):
        raise CheckpointError(f"{weights_path}: tensor 'scaling_factor' is not all ones: a fine-tuning scaling "
                              "factor is not supported (SAELens 6 does not load one either)")
    return tensors


def _dtype_name(dtype: Any) -> Optional[str]:
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"load_sae's dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return name
