"""Where SAEs and transcoders for a model come from: the ones shipped with the workbench (rows of the one table,
``wb.shipped``: the lists the dashboard offers) and a directory on this machine."""

from __future__ import annotations

from pathlib import Path

from workbench.sae import SAE, load_sae
from workbench.shipped import ZOO, artifacts

# Folders searched for shipped dictionaries: each SAELens-format directory (cfg.json + sae_weights.safetensors)
# under ``<root>/<model name>/saes/<sae name>/`` is offered for that model, each transcoder set under
# ``<root>/<model name>/transcoders/<name>/`` likewise. A new shipped one needs only its folder.
ZOO_ROOT = ZOO
SHIPPED_ROOTS = (ZOO_ROOT,)


def shipped_choices(kind: str, model_name: str | None) -> dict[str, Path]:
    """The dictionaries of ``kind`` ("sae", "transcoders" or "lens") shipped for the model called ``model_name`` (a zoo
    name such as ``toy-attn-2l``), by the label a picker shows: an SAE's name and the hook it reads, a
    transcoder set's name; empty where none is shipped.

    Example:
        >>> shipped_choices("transcoders", "toy-moe-2l")
        {'toy-moe-2l-clt': ..., 'toy-moe-2l-skip-transcoders': ...}
        >>> shipped_choices("sae", "no-such-model")
        {}
    """
    found: dict[str, Path] = {}
    if not model_name:
        return found
    for root in SHIPPED_ROOTS:
        for row in artifacts(root):
            if row.kind == kind and row.model == model_name:
                label = f"{row.name} ({row.hook_name or 'hook unknown'})" if kind == "sae" else row.name
                found[label] = Path(row.path)
    return found


def shipped_saes(model_name: str | None) -> dict[str, Path]:
    """The SAEs shipped for the model called ``model_name`` (a zoo name such as ``toy-attn-2l``), by a label
    naming the SAE and the hook it reads; empty where none is shipped.

    Example:
        >>> isinstance(shipped_saes("toy-attn-2l"), dict), shipped_saes("no-such-model")
        (True, {})
    """
    return shipped_choices("sae", model_name)


def open_sae(path: str | Path, device=None) -> SAE:
    """``wb.load_sae(path)`` on ``device`` (the model's), float32: the dashboard's one way to open an SAE.

    Example:
        >>> open_sae("/no/such/sae")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: /no/such/sae: no such directory (an SAE is a directory with cfg.json and sae_weights.safetensors)
    """
    return load_sae(path, device=device, dtype="float32")
