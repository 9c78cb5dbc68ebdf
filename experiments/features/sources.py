"""Where SAEs for a model come from: the ones shipped with the workbench (the one list the dashboard offers)
and a directory on this machine."""

from __future__ import annotations

import json
from pathlib import Path

from workbench.sae import SAE, load_sae

# Folders searched for shipped SAEs: each SAELens-format directory (cfg.json + sae_weights.safetensors) under
# ``<root>/<model name>/saes/<sae name>/`` is offered for that model. A new shipped SAE needs only its folder.
ZOO_ROOT = Path(__file__).resolve().parents[2] / "workbench" / "zoo"
SHIPPED_ROOTS = (ZOO_ROOT,)


def shipped_saes(model_name: str | None) -> dict[str, Path]:
    """The SAEs shipped for the model called ``model_name`` (a zoo name such as ``toy-attn-2l``), by a label
    naming the SAE and the hook it reads; empty where none is shipped.

    Example:
        >>> isinstance(shipped_saes("toy-attn-2l"), dict), shipped_saes("no-such-model")
        (True, {})
    """
    found: dict[str, Path] = {}
    if not model_name:
        return found
    for root in SHIPPED_ROOTS:
        folder = root / model_name / "saes"
        if not folder.is_dir():
            continue
        for cfg_path in sorted(folder.glob("*/cfg.json")):
            try:
                raw = json.loads(cfg_path.read_text())
                hook = (raw.get("metadata") or {}).get("hook_name") or raw.get("hook_name")
            except (OSError, ValueError, AttributeError):
                hook = None
            found[f"{cfg_path.parent.name} ({hook or 'hook unknown'})"] = cfg_path.parent
    return found


def open_sae(path: str | Path, device=None) -> SAE:
    """``wb.load_sae(path)`` on ``device`` (the model's), float32: the dashboard's one way to open an SAE.

    Example:
        >>> open_sae("/no/such/sae")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: /no/such/sae: no such directory (an SAE is a directory with cfg.json and sae_weights.safetensors)
    """
    return load_sae(path, device=device, dtype="float32")
