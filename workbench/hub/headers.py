"""``model_config("org/name")`` and ``plan_memory("org/name")``: config.json and the weights' headers, never the weights.

When the weights are already cached the cached snapshot is read as any local checkpoint. Otherwise
config.json is fetched (a small file, into the cache) and each safetensors file's header is read with
huggingface_hub's range requests (``parse_safetensors_file_metadata``: the first 100 kB, and the rest
of a longer header); the tensor names and dtypes are written into a temporary skeleton checkpoint,
one ``model.safetensors`` whose tensors have no elements, which the config readers open like any
other: they read names (the layer count check) and dtypes, never values. Pickled weights have no header: a
repo holding only those is refused until they are cached, then their names and dtypes are read from the
memory-mapped files (``pickled.header_dtypes``), with no copy written.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

from workbench.hub import settings
from workbench.hub.download import Fetched, HubOrigin, wanted_of
from workbench.hub.errors import HubError, hub_error
from workbench.hub.files import SAFETENSORS_INDEX, SAFETENSORS_SINGLE
from workbench.hub.names import repo_id_for
from workbench.hub.pickled import header_dtypes
from workbench.hub.resolve import RepoState, check_access, repo_state


@contextmanager
def fetch_config(source: str, *, revision: Optional[str] = None, cache_dir: Optional[Union[str, Path]] = None,
                 token: Union[str, bool, None] = None, local_files_only: bool = False) -> Iterator[Fetched]:
    """A directory with the repo's config.json and its weights' tensor names and dtypes (no weights fetched).

    Example:
        >>> with fetch_config("org/name", local_files_only=True, cache_dir="/tmp/empty-cache") as fetched:
        ...     pass
        Traceback (most recent call last):
        ...
        workbench.hub.errors.HubNotFoundError: org/name (revision 'main'): local_files_only=True, and the cache /tmp/empty-cache holds no snapshot of it (missing: ['config.json'])
    """
    repo_id = repo_id_for(source)
    with settings.online_switch():
        state = repo_state(repo_id, revision, cache_dir, token, local_files_only)
        if state.commit is None:
            raise state.missing_error(["config.json"])
        check_access(state, token)
        wanted = wanted_of(state)
        origin = HubOrigin(repo_id, state.revision, state.commit, state.endpoint, ("config.json", *wanted.weights))
        if all(state.cached(name) for name in ("config.json", *wanted.weights)):
            skeleton = None
        elif not state.online:
            raise state.missing_error([name for name in ("config.json", *wanted.weights) if not state.cached(name)])
        elif wanted.pickled:
            raise HubError(f"{state.where}: its weights are pickles ({', '.join(wanted.weights)}), which have no header "
                           "to read tensor names and dtypes from without downloading them (a memory plan from "
                           "config.json alone could not check its layer count or know the stored dtype); "
                           "load_model() it once (that fetches them): model_config() and plan_memory() then read "
                           "the cached copy")
        else:
            skeleton = _skeleton(state, [name for name in wanted.weights if name != SAFETENSORS_INDEX])
    if skeleton is None and wanted.pickled:  # cached pickles: names and dtypes from the memory-mapped files
        skeleton = (str(state.snapshot() / "config.json"), header_dtypes(state.snapshot(), wanted.weights))
    if skeleton is None:
        yield Fetched(state.snapshot(), origin)
        return
    with tempfile.TemporaryDirectory(prefix="workbench-headers-") as temporary:
        directory = Path(temporary)
        shutil.copyfile(skeleton[0], directory / "config.json")
        write_skeleton(skeleton[1], directory / SAFETENSORS_SINGLE)
        yield Fetched(directory, origin)


def _skeleton(state: RepoState, weight_files: list[str]) -> tuple[str, dict[str, str]]:
    """config.json's cached path, and tensor name -> dtype over every weight file's header (range reads)."""
    config = state.download_one("config.json")
    api, dtypes = state.api(), {}
    for name in weight_files:
        try:
            header = api.parse_safetensors_file_metadata(state.repo_id, name, revision=state.commit)
        except Exception as error:
            raise (hub_error(error, state.repo_id, state.revision, state.endpoint, name) or error) from error
        dtypes.update({tensor: info.dtype for tensor, info in header.tensors.items()})
    return config, dtypes


def write_skeleton(dtypes: dict[str, str], path: Path) -> None:
    """A safetensors file whose tensors have the given names and dtypes and no elements (a header only).

    Example:
        >>> import tempfile
        >>> from safetensors import safe_open
        >>> path = Path(tempfile.mkdtemp()) / "model.safetensors"
        >>> write_skeleton({"embed.weight": "BF16", "norm.weight": "F32"}, path)
        >>> with safe_open(str(path), framework="pt") as handle:
        ...     sorted(handle.keys()), handle.get_slice("embed.weight").get_dtype()
        (['embed.weight', 'norm.weight'], 'BF16')
    """
    header = {name: {"dtype": dtype, "shape": [0], "data_offsets": [0, 0]} for name, dtype in dtypes.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)



