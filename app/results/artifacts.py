"""The one holder of the dictionaries and lenses the pages open (SAEs, transcoder sets, tuned lenses): what is shipped for the open model
(rows of ``wb.shipped``, by the label a picker shows) and each artifact loaded once per process.

An artifact is kept by ``st.cache_resource`` under its kind, path, the stamp of its files (so rewritten files are
read again), the model it is for and the device; its results are cached on its ``key`` (never by hashing
weights): ``BY_ARTIFACT_KEY`` is the ``hash_funcs`` entry that says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import streamlit as st
import torch

import workbench as wb
from app.state import LoadedModel
from experiments.features import open_sae, shipped_choices
from experiments.lenses import TunedLens

# How each kind is opened on the model's device (the loaders' own errors propagate: pages quote them).
LOADERS: dict[str, Callable[[str, str], Any]] = {
    "sae": lambda path, device: open_sae(path, device=device),
    "transcoders": lambda path, device: wb.load_transcoders(path, device=device),
    # Read on the CPU, where attach() puts it beside the model; float32 as open_sae (a float16 lens is 3x slower there).
    "lens": lambda path, device: TunedLens.load(path).to(torch.float32),
}
SPINNERS = {"sae": "Loading the SAE …", "transcoders": "Loading the transcoders …", "lens": "Loading the tuned lens …"}
MAX_STAMPED_FILES = 200  # a folder's stamp reads at most this many files' sizes and times


@dataclass(frozen=True)
class LoadedArtifact:
    """A dictionary opened for one model, with the key its results are cached under (kind, path, stamp, model).

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> LoadedArtifact("sae", "/demo", sae, "demo").key
        'demo'
    """

    kind: str
    path: str
    artifact: Any = field(compare=False, repr=False)
    key: str


BY_ARTIFACT_KEY = {LoadedArtifact: lambda held: held.key}


def artifact_choices(loaded: LoadedModel, kind: str) -> dict[str, Path]:
    """The artifacts of ``kind`` ("sae", "transcoders", "lens") shipped for the open model, by its config's name or the
    registered name it was opened by: the one list a picker offers before "a path on this machine".

    Example:
        >>> list(artifact_choices(LoadedModel(model, "no-such-model|sdpa"), "sae"))   # toy-attn-2l ships one
        ['toy-attn-2l-resid1-topk (blocks.1.hook_resid_post)']
        >>> artifact_choices(LoadedModel(model, "toy-attn-2l|sdpa"), "transcoders")
        {}
    """
    if kind not in LOADERS:
        raise wb.InputError(f"kind must be one of {sorted(LOADERS)}, got {kind!r}")
    found: dict[str, Path] = {}
    for name in dict.fromkeys([loaded.model.cfg.model_name, loaded.key.rsplit("|", 1)[0]]):
        found.update(shipped_choices(kind, name))
    return found


def files_stamp(path: str) -> tuple:
    """Names, sizes and modification times of the files in ``path`` and its sub-folders one level down (a
    SAELens transcoder per layer), or of the file itself; () when it cannot be read.

    Example:
        >>> files_stamp("/no/such/folder")
        ()
    """
    target = Path(path)
    stamps = []
    try:
        if target.is_file():
            info = os.stat(target)
            return ((target.name, info.st_size, info.st_mtime_ns),)
        for entry in sorted(target.iterdir()):
            for file in ([entry] if entry.is_file() else sorted(entry.iterdir()) if entry.is_dir() else []):
                if len(stamps) >= MAX_STAMPED_FILES:
                    return tuple(stamps)
                if file.is_file():
                    info = os.stat(file)
                    stamps.append((str(file.relative_to(target)), info.st_size, info.st_mtime_ns))
    except OSError:
        return tuple(stamps)
    return tuple(stamps)


@st.cache_resource(show_spinner=False, max_entries=8)
def _load(kind: str, path: str, stamp: tuple, model_key: str, device: str) -> LoadedArtifact:
    return LoadedArtifact(kind, path, LOADERS[kind](path, device), f"{kind}|{path}|{hash(stamp)}|{model_key}")


def load_artifact(loaded: LoadedModel, kind: str, path: str) -> LoadedArtifact:
    """The artifact of ``kind`` at ``path`` on the model's device, loaded once per process and again when its
    files change. Load errors (``wb.CheckpointError``, ``wb.ConfigError``) propagate.

    Example:
        >>> held = load_artifact(LoadedModel(model, "toy-attn-2l|sdpa"), "sae", "toy-attn-2l-resid1-topk")
        >>> held.artifact.cfg.d_sae, held.key.startswith("sae|toy-attn-2l-resid1-topk|")
        (512, True)
        >>> load_artifact(LoadedModel(model, "toy-attn-2l|sdpa"), "transcoders", "/no/such/set")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: /no/such/set: no such file or directory (transcoders are a circuit-tracer config.yaml or its folder, a folder written by TranscoderSet.save, or SAELens transcoder directories)
    """
    if kind not in LOADERS:
        raise wb.InputError(f"kind must be one of {sorted(LOADERS)}, got {kind!r}")
    with st.spinner(SPINNERS[kind]):
        return _load(kind, str(path), files_stamp(str(path)), loaded.key, str(loaded.model.cfg.device))
