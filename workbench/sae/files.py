"""SAELens's on-disk format: a directory holding ``cfg.json`` and ``sae_weights.safetensors``.

``load_sae`` reads SAELens 6 and earlier configs (``workbench.sae.config``) and checks every tensor
(``workbench.sae.tensors``) before building anything; ``save_sae`` writes SAELens 6's format, which
SAELens's ``SAE.load_from_disk`` reads. Only those two files, directly inside the directory, are read or
written: a name that resolves outside it (a link) is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch
from packaging.version import Version
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from workbench.errors import CheckpointError, ConfigError
from workbench.sae.config import DTYPES, config_from_dict
from workbench.sae.model import SAE
from workbench.sae.tensors import check_tensors

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
# The SAELens release whose format save writes (SAELens reads a config without a 6.x version as pre-6.0).
FORMAT_VERSION = "6.54.12"


def load_sae(path: Union[str, Path], device: Any = None, dtype: Any = None) -> SAE:
    """The SAE saved in SAELens directory ``path``, on ``device`` (default CPU, as SAELens's ``load_from_disk``)
    in ``dtype`` (default the config's). A missing, unreadable, mis-shaped or non-finite file or tensor is a
    ``CheckpointError`` naming it; a config value we cannot honour a ``ConfigError`` naming the field.

    Example:
        >>> wb.load_sae("no/such/sae")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: no/such/sae: no such directory (an SAE is a directory with cfg.json and sae_weights.safetensors)
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{path}: no such directory (an SAE is a directory with {CFG_FILE} and {WEIGHTS_FILE})")
    cfg_path, weights_path = _inside(folder, CFG_FILE), _inside(folder, WEIGHTS_FILE)
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


def save_sae(sae: SAE, path: Union[str, Path]) -> Path:
    """Writes ``sae`` into directory ``path`` in SAELens 6's format (``SAE.save``). Returns ``path``.

    Example:
        >>> import tempfile
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=3), {"W_enc": torch.ones(2, 3),
        ...     "W_dec": torch.ones(3, 2), "b_enc": torch.zeros(3), "b_dec": torch.zeros(2)})
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     sorted(p.name for p in save_sae(sae, folder).iterdir())
        ['cfg.json', 'sae_weights.safetensors']
    """
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{path}: exists and is not a directory")
    folder.mkdir(parents=True, exist_ok=True)
    cfg_path, weights_path = _inside(folder, CFG_FILE, must_exist=False), _inside(folder, WEIGHTS_FILE, must_exist=False)
    config = sae.cfg.to_dict()
    version = config["metadata"].get("sae_lens_version")
    if not version or Version(str(version)) < Version("6.0.0-rc.0"):
        config["metadata"]["sae_lens_version"] = FORMAT_VERSION
    save_file({name: param.detach().contiguous() for name, param in sae.state_dict().items()}, str(weights_path))
    cfg_path.write_text(json.dumps(config))
    return folder


def _inside(folder: Path, name: str, must_exist: bool = True) -> Path:
    """``folder / name``, refused when it resolves outside ``folder`` (a link) or, with ``must_exist``, is missing."""
    target = folder / name
    if not target.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"{target}: resolves outside the SAE directory ({target.resolve()}); refusing to use it")
    if must_exist and not target.is_file():
        raise CheckpointError(f"{target}: missing (an SAE directory holds {CFG_FILE} and {WEIGHTS_FILE})")
    return target


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
