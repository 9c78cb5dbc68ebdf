"""``load_model("org/name")``: the files a load reads, fetched into the standard HF cache, then loaded locally.

What is fetched is what the loader reads (``workbench.hub.files``), checked against the free disk
first (``workbench.hub.disk``), downloaded by ``huggingface_hub.snapshot_download`` with exact
allow-patterns (a progress bar, resumable within the process, the same cache ``transformers`` uses, so
a model either fetched loads with no network), then checked whole against the repo's listed sizes.
``download_model`` fetches the same files without loading them, reporting the bytes as they arrive (the
dashboard's progress bar). Remote code is never fetched, let alone run: ``auto_map`` in config.json is ignored. The commit the
revision resolved to is recorded as ``HubOrigin`` on the model.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

from huggingface_hub import snapshot_download
from tqdm.auto import tqdm

from workbench.errors import CheckpointError
from workbench.hub import settings
from workbench.hub.disk import check_disk_space
from workbench.hub.errors import HubError, hub_error
from workbench.hub.files import PICKLE_SINGLE, SAFETENSORS_SINGLE, Wanted, wanted_files
from workbench.hub.names import repo_id_for
from workbench.hub.pickled import as_safetensors
from workbench.hub.resolve import LIBRARY, RepoState, check_access, repo_state
from workbench.hub.resume import resume_partials


@dataclass(frozen=True)
class HubOrigin:
    """Where a model loaded from the Hub came from: ``model.hub_origin`` (None for other loads).

    ``repo_id`` (after TransformerLens's names), ``revision`` as asked ("main", a tag, a sha), ``commit``
    (the sha it resolved to: pass it as ``revision=`` to load exactly these weights again), ``endpoint``
    and ``files`` (what was read).

    Example:
        >>> origin = HubOrigin("org/name", "main", "0123456789abcdef0123456789abcdef01234567",
        ...                    "https://huggingface.co", ("config.json", "model.safetensors"))
        >>> origin.commit[:7]
        '0123456'
    """

    repo_id: str
    revision: str
    commit: str
    endpoint: str
    files: tuple[str, ...]


@dataclass(frozen=True)
class Fetched:
    """A fetched checkpoint: ``path`` (a directory, or a .gguf file) to load, and its ``origin``."""

    path: Path
    origin: HubOrigin


@contextmanager
def fetch_model(source: str, *, revision: Optional[str] = None, cache_dir: Optional[Union[str, Path]] = None,
                token: Union[str, bool, None] = None, local_files_only: bool = False, gguf_file: Optional[str] = None,
                progress: Optional[bool] = None) -> Iterator[Fetched]:
    """The local checkpoint of Hub repo ``source`` (a repo id or TransformerLens name), downloaded if need be.

    Args:
        source: "org/name", a legacy "name", or a TransformerLens name ("gpt2-small").
        revision: branch, tag or commit sha (default "main").
        cache_dir: the HF cache to use (default: ``HF_HUB_CACHE`` / ``HF_HOME``/hub, read now).
        token: a Hub token (default: ``HF_TOKEN``, else the stored login).
        local_files_only: never ask the Hub; use the cache (as ``HF_HUB_OFFLINE=1`` does).
        gguf_file: fetch and load this .gguf file of the repo instead of its HF checkpoint.
        progress: the download's progress bar: True/False, or None for huggingface_hub's default.

    Example:
        >>> with fetch_model("org/name", local_files_only=True, cache_dir="/tmp/empty-cache") as fetched:
        ...     pass
        Traceback (most recent call last):
        ...
        workbench.hub.errors.HubNotFoundError: org/name (revision 'main'): local_files_only=True, and the cache /tmp/empty-cache holds no snapshot of it (missing: ['config.json'])
    """
    snapshot, wanted, origin = _fetch(source, revision, cache_dir, token, local_files_only, gguf_file,
                                      _progress_bar(progress))
    if gguf_file is not None:
        yield Fetched(snapshot / gguf_file, origin)
    elif wanted.pickled:
        companions = [name for name in wanted.files if name not in wanted.weights]
        with as_safetensors(snapshot, wanted.weights, companions) as directory:
            yield Fetched(directory, origin)
    else:
        yield Fetched(snapshot, origin)


def download_model(source: str, *, revision: Optional[str] = None, cache_dir: Optional[Union[str, Path]] = None,
                   token: Union[str, bool, None] = None, local_files_only: bool = False,
                   gguf_file: Optional[str] = None,
                   on_progress: Optional[Callable[[int, int], None]] = None) -> Fetched:
    """The files ``load_model(source)`` reads, in the HF cache (downloaded if need be), without loading them: the
    cached snapshot (or .gguf file) and its origin. ``on_progress(done_bytes, total_bytes)`` is called as the
    bytes arrive (from huggingface_hub's download threads); the other arguments as ``fetch_model``'s.

    Example:
        >>> download_model("org/name", local_files_only=True, cache_dir="/tmp/empty-cache")
        Traceback (most recent call last):
        ...
        workbench.hub.errors.HubNotFoundError: org/name (revision 'main'): local_files_only=True, and the cache /tmp/empty-cache holds no snapshot of it (missing: ['config.json'])
    """
    bar = _reporting_bar(on_progress) if on_progress is not None else None
    snapshot, _, origin = _fetch(source, revision, cache_dir, token, local_files_only, gguf_file, bar)
    return Fetched(snapshot / gguf_file if gguf_file is not None else snapshot, origin)


def _fetch(source: str, revision: Optional[str], cache_dir: Optional[Union[str, Path]], token: Union[str, bool, None],
           local_files_only: bool, gguf_file: Optional[str], bar: Optional[type]) -> tuple[Path, Wanted, HubOrigin]:
    """The cached snapshot holding every file a load reads, those files, and the origin."""
    repo_id = repo_id_for(source)
    with settings.online_switch():
        state = repo_state(repo_id, revision, cache_dir, token, local_files_only, anchor=gguf_file or "config.json")
        if state.commit is None:
            raise state.missing_error([gguf_file or "config.json"])
        check_access(state, token)
        wanted = wanted_of(state, gguf_file)
        snapshot = _download(state, wanted, bar) if state.online else _cached(state, wanted)
    return snapshot, wanted, HubOrigin(repo_id, state.revision, snapshot.name, state.endpoint, wanted.files)


def wanted_of(state: RepoState, gguf_file: Optional[str] = None) -> Wanted:
    """The files a load reads from this repo (offline: a snapshot with no weights is a missing-files error).

    Example:
        >>> from workbench.hub.resolve import repo_state
        >>> state = repo_state("org/name", None, "/tmp/empty-cache", None, local_files_only=True)
        >>> state.sizes = {"config.json": 10, "model.safetensors": 100}
        >>> wanted_of(state).files
        ('config.json', 'model.safetensors')
    """
    try:
        return wanted_files(state.sizes, state.read_index, state.where, gguf_file)
    except HubError:
        raise
    except CheckpointError as error:
        if state.online:
            raise
        raise state.missing_error([f"{SAFETENSORS_SINGLE} (or its shards) or {PICKLE_SINGLE}"]) from error


def _cached(state: RepoState, wanted: Wanted) -> Path:
    """The cached snapshot, when it holds every file the load reads."""
    missing = [name for name in wanted.files if not state.cached(name)]
    if missing:
        raise state.missing_error(missing)
    return state.snapshot()


def _download(state: RepoState, wanted: Wanted, bar: Optional[type]) -> Path:
    """Every wanted file in the cache (after the disk check), the snapshot checked whole."""
    to_download = {name: state.sizes.get(name) or 0 for name in wanted.files if not state.cached(name)}
    # A killed download's partial files: continued from their last byte, or deleted (huggingface_hub would not).
    resume_partials(state.repo_id, list(to_download), state.commit, state.endpoint, state.cache, state.token)
    check_disk_space(state.repo_id, to_download, state.cache)
    try:
        folder = snapshot_download(state.repo_id, revision=state.revision, cache_dir=str(state.cache),
                                   token=state.token, endpoint=state.endpoint, allow_patterns=list(wanted.files),
                                   library_name=LIBRARY, tqdm_class=bar)
    except Exception as error:
        raise (hub_error(error, state.repo_id, state.revision, state.endpoint) or error) from error
    snapshot = Path(folder)
    for name in wanted.files:
        path, listed = snapshot / name, state.sizes.get(name)
        if not path.is_file():
            raise HubError(f"{state.where}: {name} is missing from the snapshot {snapshot} after the download")
        if listed is not None and path.stat().st_size != listed:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, but the Hub lists {listed} for {name}: "
                                  "an incomplete or altered download; delete it and load again")
    return snapshot


def _progress_bar(progress: Optional[bool]):
    """huggingface_hub's own bars (None), or tqdm forced on or off."""
    if progress is None:
        return None

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["disable"] = not progress
            super().__init__(*args, **kwargs)

    return Bar


def _reporting_bar(on_progress: Callable[[int, int], None]) -> type:
    """A silent tqdm class that reports the bytes done and due to ``on_progress``.

    huggingface_hub gives the class its byte bars (each file's bytes counted into them, their totals grown as
    files start) and its bar over files; the largest byte count of any one byte bar is what has arrived.
    """
    lock, byte_bars = threading.Lock(), []

    class Reporting(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.bytes_done = int(kwargs.get("initial") or 0)
            self.counts_bytes = kwargs.get("unit") == "B"
            if self.counts_bytes:
                with lock:
                    byte_bars.append(self)

        def update(self, n=1):
            if not self.counts_bytes:
                return
            with lock:
                self.bytes_done += int(n or 0)
                done = max(bar.bytes_done for bar in byte_bars)
                total = max(int(bar.total or 0) for bar in byte_bars)
            on_progress(done, max(total, done))

    return Reporting
