"""SAEs and transcoders shipped with the package, found by name.

They live beside the zoo's models: ``workbench/zoo/<model>/saes/<name>/`` (a SAELens directory: ``cfg.json``,
``sae_weights.safetensors``; the layout ``experiments.features.shipped_saes`` offers in the dashboard) and
``workbench/zoo/<model>/transcoders/<name>/`` (what ``wb.load_transcoders`` reads: our ``transcoders.json`` or
one SAELens transcoder directory per layer), each with a ``CARD.md`` giving its recipe and measured quality.
``wb.load_sae(name)`` loads a shipped SAE by its name; ``shipped_saes()`` lists them all, as
``wb.list_models()`` lists models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pandas as pd

ZOO = Path(__file__).resolve().parents[1] / "zoo"
COLUMNS = ["name", "kind", "model", "hook_name", "architecture", "d_sae", "path"]


def shipped_saes() -> pd.DataFrame:
    """Every shipped SAE (``kind`` "sae") and transcoder set (``kind`` "transcoders"): name, model, the hook it
    reads, architecture, width, path.

    Example:
        >>> table = wb.shipped_saes()
        >>> table.columns.tolist()
        ['name', 'kind', 'model', 'hook_name', 'architecture', 'd_sae', 'path']
    """
    rows = []
    for folder in sorted(ZOO.glob("*/saes/*/")):
        if (folder / "cfg.json").is_file():
            rows.append(_row(folder, "sae", json.loads((folder / "cfg.json").read_text())))
    for folder in sorted(ZOO.glob("*/transcoders/*/")):
        if (folder / "transcoders.json").is_file():  # our TranscoderSet format
            config = json.loads((folder / "transcoders.json").read_text())
            rows.append({"name": folder.name, "kind": "transcoders", "model": folder.parents[1].name,
                         "hook_name": config.get("feature_input_hook"), "architecture": "cross_layer_transcoder"
                         if config.get("cross_layer", True) else "transcoder_set", "d_sae": None, "path": str(folder)})
        else:  # one SAELens transcoder per layer
            layers = sorted(p for p in folder.glob("*/cfg.json"))
            if layers:
                rows.append(_row(folder, "transcoders", json.loads(layers[0].read_text())))
    return pd.DataFrame(rows, columns=COLUMNS)


def _row(folder: Path, kind: str, cfg: dict) -> dict:
    meta = cfg.get("metadata") or {}
    return {"name": folder.name, "kind": kind, "model": folder.parents[1].name, "hook_name": meta.get("hook_name"),
            "architecture": cfg.get("architecture"), "d_sae": cfg.get("d_sae"), "path": str(folder)}


def shipped_path(name: object) -> Optional[Path]:
    """The directory of the shipped SAE named ``name`` (None when there is none).

    Example:
        >>> shipped_path("no-such-sae") is None
        True
    """
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        return None
    found = sorted(p for p in ZOO.glob(f"*/saes/{name}") if (p / "cfg.json").is_file())
    return found[0] if found else None
