"""One repo at one revision, as the Hub lists it now or, offline, as the cache holds it.

Online (``HF_HUB_OFFLINE`` unset, ``local_files_only=False``, the Hub answering): the repo's info with
every file's size and the commit the revision points to. Otherwise, or when the Hub cannot be reached:
the cached snapshot of that revision (``refs/<revision>`` -> ``snapshots/<commit>``), whoever put it there
(``snapshot_download``, ``transformers``' per-file downloads), listed by its cached tree when there is one.
A file counts as cached only when the snapshot holds it: huggingface_hub writes each download to a
``*.incomplete`` file in ``blobs/`` and links it into the snapshot only once it is whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from huggingface_hub import HfApi, get_cached_repo_tree, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import CachedRepoTreeNotFoundError, OfflineModeIsEnabled

from workbench.errors import CheckpointError
from workbench.hub import settings
from workbench.hub.errors import HubAccessError, HubNotFoundError, access_advice, hub_error
from workbench.hub.files import KNOWN_FILES

LIBRARY = "workbench"


def _connection_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the Hub cannot be reached", for whichever HTTP client huggingface_hub uses."""
    errors: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for module_name in ("httpx2", "httpx"):
        try:
            errors.append(__import__(module_name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


CONNECTION_ERRORS = _connection_errors()


@dataclass
class RepoState:
    """Where one repo's files are: ``commit`` (the sha ``revision`` resolves to), ``sizes`` (file -> bytes, None
    where unknown), ``online`` (False: only the cache, for the reason ``offline_reason``) and ``cache``."""

    repo_id: str
    revision: str
    commit: Optional[str]
    endpoint: str
    cache: Path
    token: Union[str, bool, None]
    sizes: dict[str, Optional[int]]
    online: bool
    offline_reason: str
    gated: bool = False

    @property
    def where(self) -> str:
        return f"{self.repo_id} (revision {self.revision!r})"

    def api(self) -> HfApi:
        return HfApi(endpoint=self.endpoint, token=self.token, library_name=LIBRARY)

    def snapshot(self) -> Path:
        return self.cache / f"models--{self.repo_id.replace('/', '--')}" / "snapshots" / str(self.commit)

    def cached(self, name: str) -> bool:
        """The snapshot holds ``name`` whole."""
        return self.commit is not None and isinstance(
            try_to_load_from_cache(self.repo_id, name, cache_dir=str(self.cache), revision=self.commit), str)

    def read_index(self, name: str) -> dict:
        """A shard index's JSON (downloaded when online and not cached: a small file, no weights)."""
        if self.online and not self.cached(name):
            path = Path(self.download_one(name))
        else:
            path = self.snapshot() / name
            if not path.is_file():
                raise self.missing_error([name])
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{self.where}: {name} is unreadable ({error})") from error

    def download_one(self, name: str) -> str:
        """One small file into the cache at ``commit`` (a shard index, config.json)."""
        try:
            return hf_hub_download(self.repo_id, name, revision=self.commit, cache_dir=str(self.cache),
                                   token=self.token, endpoint=self.endpoint, library_name=LIBRARY)
        except Exception as error:
            raise (hub_error(error, self.repo_id, self.revision, self.endpoint, name) or error) from error

    def missing_error(self, missing: list[str]) -> HubNotFoundError:
        """The error for files a load needs that the cache lacks while the Hub cannot be asked (``whole_repo``
        when the cache holds no snapshot of this revision at all)."""
        held = "holds no snapshot of it" if self.commit is None else f"holds commit {self.commit} without them"
        return HubNotFoundError(f"{self.where}: {self.offline_reason}, and the cache {self.cache} {held} "
                                f"(missing: {missing})", whole_repo=self.commit is None)


def repo_state(repo_id: str, revision: Optional[str], cache_dir: Optional[Union[str, Path]],
               token: Union[str, bool, None], local_files_only: bool, anchor: str = "config.json") -> RepoState:
    """The repo as the Hub lists it now, or (offline, ``local_files_only``, Hub unreachable) as the cache holds it.

    ``anchor``: the file that must be cached for an offline snapshot to count (config.json, or a GGUF file).

    Example:
        >>> state = repo_state("org/not-cached", None, "/tmp/empty-cache", None, local_files_only=True)
        >>> state.online, state.commit, state.offline_reason
        (False, None, 'local_files_only=True')
    """
    revision = revision or "main"
    state = RepoState(repo_id, revision, None, settings.endpoint(), settings.cache_dir(cache_dir), token, {},
                      online=False, offline_reason="")
    if local_files_only:
        state.offline_reason = "local_files_only=True"
    elif settings.offline():
        state.offline_reason = "the Hub is switched off (HF_HUB_OFFLINE=1)"
    else:
        try:
            info = state.api().model_info(repo_id, revision=revision, files_metadata=True)
        except CONNECTION_ERRORS as error:
            state.offline_reason = f"the Hub at {state.endpoint} could not be reached ({type(error).__name__}: {error})"
        except Exception as error:
            raise (hub_error(error, repo_id, revision, state.endpoint) or error) from error
        else:
            state.online, state.commit, state.gated = True, info.sha, bool(info.gated)
            state.sizes = {sibling.rfilename: sibling.size for sibling in info.siblings or []}
            return state
    cached_anchor = try_to_load_from_cache(repo_id, anchor, cache_dir=str(state.cache), revision=revision)
    if isinstance(cached_anchor, str):
        state.commit = Path(cached_anchor).parent.name
        state.sizes = _cached_listing(state)
    return state


def check_access(state: RepoState, explicit_token: Union[str, bool, None]) -> None:
    """A gated repo with no token at all is refused before anything is asked of it.

    Example:
        >>> state = repo_state("org/x", None, "/tmp/empty-cache", None, local_files_only=True)
        >>> check_access(state, None)   # not known to be gated
    """
    from huggingface_hub import get_token

    if state.gated and not explicit_token and get_token() is None:
        raise HubAccessError(f"{state.where} on {state.endpoint} is gated and no token is set: "
                             f"{access_advice(state.repo_id, state.endpoint)}")


def _cached_listing(state: RepoState) -> dict[str, Optional[int]]:
    """The files of the cached snapshot: its cached tree listing (every file of the commit, with sizes) when
    there is one, else the files a load reads that the snapshot holds."""
    try:
        tree = get_cached_repo_tree(state.repo_id, revision=state.commit, cache_dir=str(state.cache))
        return {entry.path: entry.size for entry in tree}
    except CachedRepoTreeNotFoundError:
        snapshot = state.snapshot()
        present = {path.name for path in snapshot.iterdir() if path.is_file()} if snapshot.is_dir() else set()
        return {name: None for name in present if name in KNOWN_FILES or name.endswith((".safetensors", ".bin", ".gguf"))}
