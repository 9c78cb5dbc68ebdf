"""An SAE in a folder of any Hub repo: ``wb.load_sae("org/repo", folder="path", revision=None)``.

The folder holds one of two layouts, told apart by the repo's file listing (online) or by what the cache holds
(offline, ``HF_HUB_OFFLINE=1``): SAELens's (``cfg.json`` and ``sae_weights.safetensors``, read as a SAELens
directory is) or EleutherAI sparsify's (``cfg.json`` and ``sae.safetensors``, converted by
``workbench.sae.foreign.sparsify``; the run's ``config.json`` in the folder's parent is fetched too when the repo
has one). SAELens wins where a folder holds both. A folder with neither is an error naming the repo, the revision,
the folder and what it holds. The files come through ``workbench.hub.sae_releases.fetch_files`` (the standard HF
cache; ``HF_ENDPOINT`` and the offline switch read at the call). ``fetch_sae_folder`` fetches and converts;
``workbench.sae.files.load_sae`` builds the checked SAE from what it returns (so this module needs no reader).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from huggingface_hub import try_to_load_from_cache
from torch import Tensor

from workbench.errors import CheckpointError, InputError
from workbench.hub import settings
from workbench.hub.errors import HubNotFoundError
from workbench.hub.resolve import repo_state
from workbench.hub.sae_releases import fetch_files
from workbench.sae.foreign import sparsify

# Layout name -> the files of the folder it needs, in the order they are fetched (config first).
LAYOUTS: dict[str, tuple[str, str]] = {"sae_lens": ("cfg.json", "sae_weights.safetensors"),
                                       "sparsify": (sparsify.CFG_FILE, sparsify.WEIGHTS_FILE)}


@dataclass
class FolderSAE:
    """What a repo folder held: its ``layout``, ``source`` (``repo/folder``) and either the SAELens files
    (``cfg_path``, ``weights_path``) or a converted SAELens config and tensors (``raw``, ``tensors``)."""

    layout: str
    source: str
    cfg_path: Optional[Path] = None
    weights_path: Optional[Path] = None
    raw: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)


def repo_folder(folder: Any) -> str:
    """``folder`` as a path inside a repo ("" for its root); an absolute path or one with ``..`` is an ``InputError``.

    Example:
        >>> repo_folder("layers.3/"), repo_folder("."), repo_folder("a/b")
        ('layers.3', '', 'a/b')
        >>> repo_folder("../secrets")
        Traceback (most recent call last):
        workbench.errors.InputError: load_sae's folder= is a folder inside the repo (no '..', not absolute), got '../secrets'
    """
    if not isinstance(folder, str) or "\\" in folder or folder.startswith("/") or \
            any(part == ".." for part in folder.split("/")):
        raise InputError(f"load_sae's folder= is a folder inside the repo (no '..', not absolute), got {folder!r}")
    parts = [part for part in PurePosixPath(folder).parts if part != "."]
    return "/".join(parts)


def fetch_sae_folder(repo_id: str, folder: str, revision: Optional[str] = None) -> FolderSAE:
    """The SAE files of ``folder`` in Hub repo ``repo_id`` at ``revision`` (default its main branch), fetched into
    the HF cache; a sparsify folder comes back converted to SAELens's config and tensors.

    Example:
        >>> fetch_sae_folder("org/no-such-saes", "layers.3")   # the suite runs offline, nothing cached
        Traceback (most recent call last):
        workbench.hub.errors.HubNotFoundError: org/no-such-saes (revision 'main'): the Hub is switched off (HF_HUB_OFFLINE=1), and the cache ... holds no copy of layers.3/cfg.json with ...
    """
    folder = repo_folder(folder)
    prefix = f"{folder}/" if folder else ""
    with settings.online_switch():
        state = repo_state(repo_id, revision, None, None, local_files_only=False, anchor=f"{prefix}cfg.json")
    held = (lambda name: name in state.sizes) if state.online else (lambda name: isinstance(
        try_to_load_from_cache(repo_id, name, cache_dir=str(state.cache), revision=state.revision), str))
    layout = next((name for name, files in LAYOUTS.items() if all(held(prefix + file) for file in files)), None)
    if layout is None and not state.online:
        raise HubNotFoundError(f"{state.where}: {state.offline_reason}, and the cache {state.cache} holds no copy of "
                               f"{prefix}cfg.json with {prefix}sae_weights.safetensors or {prefix}sae.safetensors",
                               whole_repo=True)
    if layout is None:
        inside = sorted(name[len(prefix):] for name in state.sizes if name.startswith(prefix))
        raise CheckpointError(f"{state.where}: folder {folder or '(the repo root)'!r} holds neither a SAELens SAE "
                              f"(cfg.json and sae_weights.safetensors) nor a sparsify SAE (cfg.json and "
                              f"sae.safetensors); it holds {inside[:20] or 'nothing'}")
    source = f"{repo_id}/{folder}" if folder else repo_id
    if layout == "sae_lens":
        cfg_path, weights_path = fetch_files(repo_id, [prefix + file for file in LAYOUTS[layout]], state.revision)
        return FolderSAE(layout, source, cfg_path=cfg_path, weights_path=weights_path)
    row, entry = {"repo_id": repo_id}, {"path": folder}
    names = sparsify.SPARSIFY.files(folder, row, entry)
    if held(sparsify.run_config_file(folder)):
        names.append(sparsify.run_config_file(folder))
    raw, tensors = sparsify.SPARSIFY.convert(dict(zip(names, fetch_files(repo_id, names, state.revision))), row, entry)
    return FolderSAE(layout, source, raw=raw, tensors=tensors)
