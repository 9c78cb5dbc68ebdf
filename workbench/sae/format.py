"""SAELens 6's on-disk format: a directory holding ``cfg.json`` and ``sae_weights.safetensors``; writing it.

``save_sae`` writes what SAELens's ``SAE.load_from_disk`` reads (``tests/fixtures/sae/make_sae_fixtures.py``
proves it). Only those two files, directly inside the directory, are read or written (``workbench.safe_files``:
a name that resolves outside it through a link is refused), and a save writes both to temporary names first and
renames them into place, so a failed save leaves the previous SAE loadable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Protocol, Union

from packaging.version import Version
from safetensors.torch import save_file
from torch import Tensor

from workbench.safe_files import save_files
from workbench.sae.config import SAEConfig

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
# The SAELens release whose format save writes (SAELens reads a config without a 6.x version as pre-6.0).
FORMAT_VERSION = "6.54.12"


class SavedSAE(Protocol):
    """What a save reads of an SAE (a ``wb.SAE``): its config and its tensors by SAELens's names."""

    cfg: SAEConfig

    def state_dict(self) -> Mapping[str, Tensor]: ...


def save_sae(sae: SavedSAE, path: Union[str, Path]) -> Path:
    """Writes ``sae`` (a ``wb.SAE``) into directory ``path`` in SAELens 6's format (``SAE.save``). Returns ``path``.

    Example:
        >>> import tempfile
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=3), {"W_enc": torch.ones(2, 3),
        ...     "W_dec": torch.ones(3, 2), "b_enc": torch.zeros(3), "b_dec": torch.zeros(2)})
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     sorted(p.name for p in save_sae(sae, folder).iterdir())
        ['cfg.json', 'sae_weights.safetensors']
    """
    config = sae.cfg.to_dict()
    version = config["metadata"].get("sae_lens_version")
    if not version or Version(str(version)) < Version("6.0.0-rc.0"):
        config["metadata"]["sae_lens_version"] = FORMAT_VERSION
    tensors = {name: param.detach().contiguous() for name, param in sae.state_dict().items()}
    text = json.dumps(config)
    return save_files(path, {WEIGHTS_FILE: lambda target: save_file(tensors, str(target)),
                             CFG_FILE: lambda target: target.write_text(text)}, what="SAE directory")
