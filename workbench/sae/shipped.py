"""SAEs and transcoders shipped with the package (``workbench/zoo/saes/<name>/``), found by name.

Each is a SAELens directory (``cfg.json``, ``sae_weights.safetensors``) or a transcoder set
(``transcoders.json``), with a ``CARD.md`` giving its recipe and measured quality. ``wb.load_sae(name)`` and
``wb.load_transcoders(path)`` read them; ``shipped_saes()`` lists them, as ``wb.list_models()`` lists models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pandas as pd

SHIPPED = Path(__file__).resolve().parents[1] / "zoo" / "saes"


def shipped_saes() -> pd.DataFrame:
    """Every shipped SAE or transcoder set: name, kind, model, hook, architecture, width, path.

    Example:
        >>> table = wb.sae.shipped.shipped_saes()
        >>> table.columns.tolist()
        ['name', 'kind', 'model', 'hook_name', 'architecture', 'd_sae', 'path']
    """
    rows = []
    for folder in sorted(SHIPPED.iterdir()) if SHIPPED.is_dir() else []:
        if (folder / "cfg.json").is_file():
            cfg = json.loads((folder / "cfg.json").read_text())
            meta = cfg.get("metadata", {})
            rows.append({"name": folder.name, "kind": "sae", "model": meta.get("model_name"),
                         "hook_name": meta.get("hook_name"), "architecture": cfg.get("architecture"),
                         "d_sae": cfg.get("d_sae"), "path": str(folder)})
        elif (folder / "transcoders.json").is_file():  # our TranscoderSet format; scan names the model
            config = json.loads((folder / "transcoders.json").read_text())
            rows.append({"name": folder.name, "kind": "transcoders", "model": config.get("scan"),
                         "hook_name": config.get("feature_input_hook"), "architecture": "transcoder_set",
                         "d_sae": None, "path": str(folder)})
        elif any((sub / "cfg.json").is_file() for sub in folder.iterdir()):  # per-layer SAELens transcoders
            first = json.loads(next(sub / "cfg.json" for sub in sorted(folder.iterdir()) if (sub / "cfg.json").is_file())
                               .read_text())
            rows.append({"name": folder.name, "kind": "transcoders", "model": first.get("metadata", {}).get("model_name"),
                         "hook_name": first.get("metadata", {}).get("hook_name"),
                         "architecture": first.get("architecture"), "d_sae": first.get("d_sae"), "path": str(folder)})
    return pd.DataFrame(rows, columns=["name", "kind", "model", "hook_name", "architecture", "d_sae", "path"])


def shipped_path(name: object) -> Optional[Path]:
    """The directory of the shipped SAE or transcoder set named ``name`` (None when there is none).

    Example:
        >>> shipped_path("no-such-sae") is None
        True
    """
    if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
        return None
    folder = SHIPPED / name
    return folder if folder.is_dir() else None
