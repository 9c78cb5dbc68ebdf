"""Stamps of weights-cache entries whose digest a load has checked, so the next load of the same unchanged file
skips the hash (for SmolLM2's 540 MB entry the check costs more than the rest of a cached load).

A stamp, ``cache_directory()/weights-verified/<entry name>.json``, records the entry file's state (device, inode,
size, mtime and ctime) and the digest its header stores. It is written only for a file unchanged for
``SETTLED_SECONDS``: any later write (truncation, a flipped byte, ``os.utime``) sets the file's ctime to the
time of that write, past the stamped one by more than a tick of the coarse file clock, and no tool sets a ctime
back. So a stamp matches only the very bytes that were checked; anything else is hashed (and caught) again.
Integrity, not authenticity, as for the digest itself (``workbench.loading.weights_cache``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from workbench.cache_dir import cache_directory
from workbench.safe_files import save_files

SUBDIRECTORY = "weights-verified"
SETTLED_SECONDS = 2.0


def file_state(path: Path) -> dict[str, int]:
    """What any write to the file at ``path`` changes: device, inode, size, mtime and ctime (nanoseconds).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "entry.safetensors"
        >>> _ = path.write_bytes(b"abc")
        >>> sorted(file_state(path)), file_state(path)["size"]
        (['ctime_ns', 'device', 'inode', 'mtime_ns', 'size'], 3)
    """
    stat = os.stat(path, follow_symlinks=False)
    return {"device": stat.st_dev, "inode": stat.st_ino, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "ctime_ns": stat.st_ctime_ns}


def stamp_path(entry: Path) -> Path:
    """Where the stamp of the cache entry ``entry`` lives (beside ``weights/``, never in it).

    Example:
        >>> stamp_path(Path("model.gguf-abc-def.safetensors")).name
        'model.gguf-abc-def.safetensors.json'
    """
    return cache_directory() / SUBDIRECTORY / f"{entry.name}.json"


def was_verified(entry: Path, state: dict[str, int], digest: str) -> bool:
    """Whether a load already checked ``entry``'s ``digest`` against its bytes and the file, now in ``state``,
    has not changed since.

    Example:
        >>> import tempfile
        >>> from unittest import mock
        >>> entry = Path(tempfile.mkdtemp()) / "entry.safetensors"
        >>> _ = entry.write_bytes(b"abc")
        >>> with mock.patch.dict(os.environ, {"WORKBENCH_CACHE_DIR": tempfile.mkdtemp()}):
        ...     settled = {**file_state(entry), "ctime_ns": 0}   # as if written long ago
        ...     before = was_verified(entry, settled, "d1")
        ...     remember_verified(entry, settled, "d1")
        ...     after = was_verified(entry, settled, "d1"), was_verified(entry, {**settled, "size": 4}, "d1")
        >>> before, after
        (False, (True, False))
    """
    try:
        stamp = json.loads(stamp_path(entry).read_text())
    except (OSError, ValueError):
        return False
    return stamp == {"state": state, "digest": digest}


def remember_verified(entry: Path, state: dict[str, int], digest: str) -> None:
    """Stamps ``entry`` (in ``state``, its ``digest`` just checked) once its last change is ``SETTLED_SECONDS``
    old; a younger file is not stamped (a write within the same clock tick could keep its times). Best effort:
    a stamp that cannot be written means the next load hashes again.

    Example:
        >>> remember_verified(Path("entry.safetensors"), {"ctime_ns": time.time_ns()}, "d1")   # too young: no stamp
    """
    if time.time_ns() - state["ctime_ns"] < SETTLED_SECONDS * 1e9:
        return
    stamp = stamp_path(entry)
    text = json.dumps({"state": state, "digest": digest})
    try:
        save_files(stamp.parent, {stamp.name: lambda temporary: Path(temporary).write_text(text)},
                   what="weights cache stamp")
    except Exception:
        return


def prune_stamps(entries: Path) -> None:
    """Removes the stamps whose entry is no longer in the folder ``entries``. Best effort.

    Example:
        >>> prune_stamps(cache_directory() / "weights")
    """
    try:
        stamps = list((cache_directory() / SUBDIRECTORY).glob("*.json"))
    except OSError:
        return
    for stamp in stamps:
        try:
            if not (entries / stamp.name[:-len(".json")]).exists():
                stamp.unlink(missing_ok=True)
        except OSError:
            continue
