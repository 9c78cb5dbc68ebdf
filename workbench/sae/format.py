"""SAELens 6's on-disk format: a directory holding ``cfg.json`` and ``sae_weights.safetensors``; writing it.

``save_sae`` writes what SAELens's ``SAE.load_from_disk`` reads (``tests/fixtures/sae/make_sae_fixtures.py``
proves it). Only those two files, directly inside the directory, are read or written: a name that resolves
outside it (a link) is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Union

from packaging.version import Version
from safetensors.torch import save_file

from workbench.errors import CheckpointError

if TYPE_CHECKING:
    from workbench.sae.model import SAE

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
# The SAELens release whose format save writes (SAELens reads a config without a 6.x version as pre-6.0).
FORMAT_VERSION = "6.54.12"


def save_sae(sae: "SAE", path: Union[str, Path]) -> Path:
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
    cfg_path, weights_path = inside(folder, CFG_FILE, must_exist=False), inside(folder, WEIGHTS_FILE, must_exist=False)
    config = sae.cfg.to_dict()
    version = config["metadata"].get("sae_lens_version")
    if not version or Version(str(version)) < Version("6.0.0-rc.0"):
        config["metadata"]["sae_lens_version"] = FORMAT_VERSION
    save_file({name: param.detach().contiguous() for name, param in sae.state_dict().items()}, str(weights_path))
    cfg_path.write_text(json.dumps(config))
    return folder


def inside(folder: Path, name: str, must_exist: bool = True) -> Path:
    """``folder / name``, refused when it resolves outside ``folder`` (a link) or, with ``must_exist``, is missing."""
    target = folder / name
    if not target.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"{target}: resolves outside the SAE directory ({target.resolve()}); refusing to use it")
    if must_exist and not target.is_file():
        raise CheckpointError(f"{target}: missing (an SAE directory holds {CFG_FILE} and {WEIGHTS_FILE})")
    return target
