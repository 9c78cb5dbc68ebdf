"""Transcoder sets from the Hub, resolved as circuit-tracer 0.5 resolves them, fetched into the standard HF cache.

circuit-tracer's ``load_transcoder_from_hub`` takes a preset (``"gemma"``, ``"llama"``), a reference
``org/repo[/folder][@revision]`` whose folder holds its ``config.yaml``, and, inside that YAML, ``hf://org/repo/file
[?revision=r]`` entries. Here each becomes an exact list of files: the ``config.yaml``, then only what it names (its
``transcoders`` entries; without them the folder's ``layer_{i}.safetensors``, or a cross-layer transcoder's
``W_enc_{i}`` / ``W_dec_{i}``), each fetched through ``workbench.hub.sae_releases.fetch_files`` at the commit the
revision resolved to (``workbench.hub.resolve``), after the free-disk check (``workbench.hub.disk``). circuit-tracer's
glob downloads (``snapshot_download(allow_patterns="*.safetensors")``, which match every folder) are not copied.
Addresses are checked before anything is asked of the Hub: a ``..`` step, an absolute or empty path part, a
backslash or a malformed repo id is a ``ConfigError`` naming the entry. Reading the files is
``workbench.transcoders.files``.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import parse_qs, urlsplit

from huggingface_hub import try_to_load_from_cache

from workbench.errors import ConfigError
from workbench.hub import settings
from workbench.hub.disk import check_disk_space
from workbench.hub.errors import HubNotFoundError
from workbench.hub.names import is_repo_id
from workbench.hub.resolve import RepoState, check_access, repo_state
from workbench.hub.sae_releases import fetch_files

# circuit-tracer 0.5's presets (``load_transcoder_from_hub``'s "legacy references").
PRESETS = {"gemma": "mwhanna/gemma-scope-transcoders", "llama": "mntss/transcoder-Llama-3.2-1B"}
CONFIG_FILE = "config.yaml"
# No model has this many layers; a config naming more Hub files than this is refused before any is fetched.
MAX_LAYERS = 512
_REFERENCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(/[^@\s]+)?(@[^@\s/]+)?")


@dataclass(frozen=True)
class HubAddress:
    """A place on the Hub: ``repo_id``, ``path`` inside it (a folder for a reference, a file for an ``hf://``
    entry; None for the repo's root) and ``revision`` (None: "main").

    Example:
        >>> HubAddress("org/tc", "l0/layer_0.safetensors", None).file("x")
        'l0/layer_0.safetensors/x'
    """

    repo_id: str
    path: Optional[str]
    revision: Optional[str]

    def file(self, name: str) -> str:
        """``name`` inside this address's folder.

        Example:
            >>> HubAddress("org/tc", None, None).file("config.yaml")
            'config.yaml'
        """
        return f"{self.path}/{name}" if self.path else name

    @property
    def scan(self) -> str:
        """circuit-tracer's ``scan`` for a set loaded from here: ``repo[//folder][@revision]``.

        Example:
            >>> HubAddress("org/tc", "clt", "v1").scan
            'org/tc//clt@v1'
        """
        where = self.repo_id if self.path is None else f"{self.repo_id}//{self.path}"
        return f"{where}@{self.revision}" if self.revision else where


def is_transcoder_reference(source: str) -> bool:
    """``source`` names transcoders on the Hub: a preset, an ``hf://`` address, or ``org/repo[/folder][@revision]``
    (the caller has already found no local path of that name).

    Example:
        >>> is_transcoder_reference("gemma"), is_transcoder_reference("mntss/transcoder-Llama-3.2-1B@main")
        (True, True)
        >>> is_transcoder_reference("/no/such/set"), is_transcoder_reference("no-such-transcoders")
        (False, False)
    """
    return isinstance(source, str) and (source in PRESETS or source.startswith("hf://")
                                        or (_REFERENCE.fullmatch(source) is not None
                                            and not source.endswith((".yaml", ".yml"))))


def reference(source: str) -> HubAddress:
    """Where ``source`` (a preset, ``org/repo[/folder][@revision]`` or ``hf://org/repo[/folder][?revision=r]``)
    keeps its ``config.yaml``, as circuit-tracer's ``HfUri.from_str`` reads it.

    Example:
        >>> reference("llama")
        HubAddress(repo_id='mntss/transcoder-Llama-3.2-1B', path=None, revision=None)
        >>> reference("org/sets/gemma/16k@v2")
        HubAddress(repo_id='org/sets', path='gemma/16k', revision='v2')
    """
    source = PRESETS.get(source, source)
    if source.startswith("hf://"):
        return address(source, needs_path=False)
    name, _, revision = source.partition("@")
    parts = name.split("/")
    found = HubAddress("/".join(parts[:2]), "/".join(parts[2:]) or None, revision or None)
    return _checked(found, source)


def address(entry: str, needs_path: bool = True) -> HubAddress:
    """An ``hf://org/repo/path[?revision=r]`` entry of a ``config.yaml`` (circuit-tracer's ``parse_hf_uri``), its
    path checked: relative, no ``..`` or empty step, no backslash (a ``ConfigError`` naming the entry).

    Example:
        >>> address("hf://google/gemma-scope-2b-pt-transcoders/layer_0/params.npz?revision=abc")
        HubAddress(repo_id='google/gemma-scope-2b-pt-transcoders', path='layer_0/params.npz', revision='abc')
        >>> address("hf://org/tc/../../secrets.safetensors")
        Traceback (most recent call last):
        workbench.errors.ConfigError: 'hf://org/tc/../../secrets.safetensors': ...a '..' step...
    """
    parts = urlsplit(entry)
    if parts.scheme != "hf" or not parts.netloc:
        raise ConfigError(f"{entry!r}: not an hf:// address (hf://org/repo/path[?revision=...])")
    repo, _, path = parts.path.removeprefix("/").partition("/")
    revision = (parse_qs(parts.query).get("revision") or [None])[0] or None
    found = HubAddress(f"{parts.netloc}/{repo}", path if path or parts.path.count("/") > 1 else None, revision)
    if needs_path and found.path is None:
        raise ConfigError(f"{entry!r}: an hf:// entry names a file inside a repo (hf://org/repo/path)")
    return _checked(found, entry)


def _checked(found: HubAddress, given: str) -> HubAddress:
    if not is_repo_id(found.repo_id) or "/" not in found.repo_id:
        raise ConfigError(f"{given!r}: {found.repo_id!r} is not a Hub repo id (org/name)")
    if found.path is not None:
        _check_path(found.path, given)
    return found


def _check_path(path: str, given: str) -> None:
    steps = path.split("/")
    if "\\" in path or path.startswith("/") or any(step in ("", ".", "..") for step in steps):
        raise ConfigError(f"{given!r}: its path {path!r} inside the repo is absolute, has a '..' step, an empty step "
                          "or a backslash; refusing it (a repo file is named by a plain relative path)")


@dataclass
class HubTranscoders:
    """A transcoder set's ``config.yaml`` fetched from ``where``; its files are fetched as the config names them."""

    where: HubAddress
    state: RepoState
    config_path: Path

    @property
    def shown(self) -> str:
        """How messages name the config: ``org/repo/folder/config.yaml``.

        Example:
            >>> HubTranscoders(HubAddress("org/tc", "clt", None), None, Path("config.yaml")).shown
            'org/tc/clt/config.yaml'
        """
        return f"{self.where.repo_id}/{self.where.file(CONFIG_FILE)}"

    def layer_files(self, entries: Optional[Sequence[str]]) -> list[Path]:
        """The per-layer files of a ``transcoder_set``: each entry (an ``hf://`` address, or a path relative to the
        config's folder in this repo), or without entries the folder's ``layer_{i}.safetensors`` as circuit-tracer
        counts them (``i`` below the number of ``layer_*.safetensors`` files).

        Example:
            >>> HubTranscoders(HubAddress("org/tc", None, None), None, Path("config.yaml")).layer_files(
            ...     ["/etc/layer_0.safetensors"])
            Traceback (most recent call last):
            workbench.errors.ConfigError: field 'transcoders'[0] is '/etc/layer_0.safetensors': ...absolute...
        """
        if entries is None:
            count = len(self._listed("layer_*.safetensors"))
            names = [self.where.file(f"layer_{i}.safetensors") for i in range(count)]
            if not names:
                raise HubNotFoundError(f"{self.shown} names no 'transcoders' and {self.where.scan} holds no "
                                       "layer_{i}.safetensors beside it")
            return self._fetch(names)
        if len(entries) > MAX_LAYERS:
            raise ConfigError(f"field 'transcoders' lists {len(entries)} files, more than the {MAX_LAYERS} layers any "
                              "model has")
        ours, theirs = {}, {}
        for layer, entry in enumerate(entries):
            if entry.startswith("hf://"):
                theirs[layer] = entry
                continue
            try:
                _check_path(entry, entry)
            except ConfigError as error:
                raise ConfigError(f"field 'transcoders'[{layer}] is {entry!r}: {error}") from None
            ours[layer] = posixpath.normpath(self.where.file(entry))
        fetched = dict(zip(ours, self._fetch(list(ours.values())))) if ours else {}
        fetched.update(zip(theirs, fetch_addresses(list(theirs.values())).values()) if theirs else ())
        return [fetched[layer] for layer in range(len(entries))]

    def cross_layer_folder(self) -> Path:
        """The local folder holding this cross-layer transcoder's ``W_enc_{i}`` and ``W_dec_{i}`` files (only
        those: the number of ``W_enc_*.safetensors`` beside the config gives the layers).

        Example:
            >>> state = repo_state("org/tc", None, "/tmp/empty-cache", None, local_files_only=True)
            >>> empty = HubTranscoders(HubAddress("org/tc", None, None), state, Path("/no/such/config.yaml"))
            >>> empty.cross_layer_folder()
            Traceback (most recent call last):
            workbench.hub.errors.HubNotFoundError: org/tc: a cross-layer transcoder needs W_enc_{i}.safetensors beside config.yaml; the repo holds none
        """
        count = len(self._listed("W_enc_*.safetensors"))
        if count == 0:
            raise HubNotFoundError(f"{self.where.scan}: a cross-layer transcoder needs W_enc_{{i}}.safetensors beside "
                                   f"{CONFIG_FILE}; the repo holds none")
        names = [self.where.file(f"{kind}_{i}.safetensors") for i in range(count) for kind in ("W_enc", "W_dec")]
        return self._fetch(names)[0].parent

    def _listed(self, pattern: str) -> list[str]:
        """The files of the config's folder (not its subfolders) matching ``pattern``: the Hub's listing, or offline
        the cached snapshot's."""
        prefix = self.where.file("")
        if self.state.online:
            names = [name.removeprefix(prefix) for name in self.state.sizes if name.startswith(prefix)]
        else:
            folder = self.config_path.parent
            names = [path.name for path in folder.iterdir() if path.is_file()] if folder.is_dir() else []
        return sorted(name for name in names if "/" not in name and fnmatchcase(name, pattern))

    def _fetch(self, names: list[str]) -> list[Path]:
        return fetch_from(self.state, names, self.shown)


def fetch_transcoder_config(source: str) -> HubTranscoders:
    """The ``config.yaml`` of transcoders ``source`` (a preset or a reference: ``reference``), fetched (offline:
    from the cache); a missing repo, revision or config is a ``HubNotFoundError`` naming it.

    Example:
        >>> fetch_transcoder_config("org/no-such-transcoders")   # the suite runs offline
        Traceback (most recent call last):
        workbench.hub.errors.HubNotFoundError: org/no-such-transcoders (revision 'main'): the Hub is switched off (HF_HUB_OFFLINE=1), and the cache ... holds no snapshot of it (missing: ['config.yaml'])
    """
    where = reference(source)
    state = _state(where.repo_id, where.revision, where.file(CONFIG_FILE))
    [config_path] = fetch_from(state, [where.file(CONFIG_FILE)], f"transcoders {source!r}")
    return HubTranscoders(where, state, config_path)


def fetch_addresses(entries: Sequence[str]) -> dict[str, Path]:
    """Each ``hf://`` entry's file, fetched (offline: from the cache), one repo state per (repo, revision).

    Example:
        >>> fetch_addresses(["hf://org/tc/layer_0.safetensors"])   # the suite runs offline
        Traceback (most recent call last):
        workbench.hub.errors.HubNotFoundError: org/tc (revision 'main'): ... holds no snapshot of it (missing: ['layer_0.safetensors'])
    """
    if len(entries) > MAX_LAYERS:
        raise ConfigError(f"field 'transcoders' names {len(entries)} hf:// files, more than the {MAX_LAYERS} layers "
                          "any model has")
    addresses = {entry: address(entry) for entry in entries}  # every entry checked before anything is fetched
    by_repo: dict[tuple[str, Optional[str]], list[str]] = {}
    for entry, where in addresses.items():
        by_repo.setdefault((where.repo_id, where.revision), []).append(entry)
    out: dict[str, Path] = {}
    for (repo_id, revision), group in by_repo.items():
        names = [addresses[entry].path for entry in group]
        state = _state(repo_id, revision, names[0])
        out.update(zip(group, fetch_from(state, names, "an hf:// entry of config.yaml")))
    return {entry: out[entry] for entry in entries}


def fetch_from(state: RepoState, names: list[str], named_by: str) -> list[Path]:
    """``names`` of the repo at the state's revision: online, checked against the listing (a file the repo lacks is a
    ``HubNotFoundError`` naming it and ``named_by``) and the free disk first; offline, from the cache.

    Example:
        >>> state = repo_state("org/tc", None, "/tmp/empty-cache", None, local_files_only=True)
        >>> fetch_from(state, ["config.yaml"], "a test")
        Traceback (most recent call last):
        workbench.hub.errors.HubNotFoundError: org/tc (revision 'main'): local_files_only=True, and the cache /tmp/empty-cache holds no snapshot of it (missing: ['config.yaml'])
    """
    if state.commit is None:
        raise state.missing_error(names)
    if state.online:
        absent = [name for name in names if name not in state.sizes]
        if absent:
            raise HubNotFoundError(f"{state.where} on {state.endpoint}: no file {', '.join(map(repr, absent))} in the "
                                   f"repo (named by {named_by})")
        check_disk_space(state.repo_id, {name: state.sizes[name] or 0 for name in names if not state.cached(name)},
                         state.cache)
    return fetch_files(state.repo_id, names, revision=state.revision)  # by name: the cache records the ref


def files_held(repo_id: str, names: Sequence[str], revision: Optional[str] = None) -> list[str]:
    """Which of ``names`` the repo holds: online, by its listing; offline, those in the cache (SAELens finds out
    by trying each download).

    Example:
        >>> files_held("org/not-cached", ["wandb-config.yaml", "config.yaml"])   # the suite runs offline
        []
    """
    state = _state(repo_id, revision, names[0])
    if state.online:
        return [name for name in names if name in state.sizes]
    return [name for name in names if isinstance(try_to_load_from_cache(repo_id, name, cache_dir=str(state.cache),
                                                                        revision=state.revision), str)]


def _state(repo_id: str, revision: Optional[str], anchor: str) -> RepoState:
    """The repo as the Hub lists it (the commit ``revision`` points to now), or offline as the cache holds it (the
    snapshot holding ``anchor``); a gated repo with no token refused here."""
    with settings.online_switch():  # huggingface_hub's own offline flag, as the environment holds it now
        state = repo_state(repo_id, revision, None, None, local_files_only=False, anchor=anchor)
    check_access(state, None)
    return state


__all__ = ["PRESETS", "HubAddress", "HubTranscoders", "is_transcoder_reference", "reference", "address",
           "fetch_transcoder_config", "fetch_addresses", "fetch_from", "files_held"]
