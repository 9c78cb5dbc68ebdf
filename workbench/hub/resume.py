"""Resuming a download another process left half-done: huggingface_hub 2.4 writes each file to an
``<etag>.<random>.incomplete`` of its own process and never picks up another's (its PR 4228), so a killed
``load_model`` would fetch a multi-GB file again from byte 0.

``resume_partials`` runs before a download: for each file still to fetch, the largest partial of that very file
(named by its current ETag, so a file changed on the Hub since is never continued) that no running download holds
is continued with a ``Range`` request from its last byte, checked whole (its size, and the digest its ETag is: an
LFS file's SHA-256, a git file's blob id) and renamed to the blob huggingface_hub would have written. huggingface_hub then
finds the blob and only links it into the snapshot. Partials of other ETags, or that fail the check, are deleted:
a partial is never loaded either way (only whole blobs are linked).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Optional, Union

from filelock import FileLock, Timeout
from huggingface_hub import get_hf_file_metadata, hf_hub_url
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers

from workbench.hub.resolve import CONNECTION_ERRORS, LIBRARY

_SHA256 = re.compile(r"[0-9a-f]{64}")
_GIT_BLOB = re.compile(r"[0-9a-f]{40}")
_CHUNK = 1 << 20


def resume_partials(repo_id: str, names: list[str], revision: str, endpoint: str, cache: Path,
                    token: Union[str, bool, None] = None) -> dict[str, int]:
    """Completes the partial downloads of ``names`` that dead processes left in the cache; returns, per file
    resumed, the byte it resumed from. Partials no file needs any more are deleted; a download running in another
    process (it holds the file's lock) is left alone.

    Example:
        >>> resume_partials("org/name", ["model.safetensors"], "main", "http://127.0.0.1:9", Path("/tmp/empty-cache"))
        {}
    """
    folder = f"models--{repo_id.replace('/', '--')}"
    blobs, locks = Path(cache) / folder / "blobs", Path(cache) / ".locks" / folder
    partials = sorted(blobs.glob("*.incomplete")) if blobs.is_dir() else []
    if not partials:
        return {}
    resumed: dict[str, int] = {}
    kept: set[Path] = set()  # the partial of each needed file, kept when it could not be continued now
    for name in names:
        try:
            meta = get_hf_file_metadata(hf_hub_url(repo_id, name, revision=revision, endpoint=endpoint), token=token,
                                        library_name=LIBRARY, endpoint=endpoint)
        except CONNECTION_ERRORS:
            return resumed  # the download that follows says the Hub cannot be reached
        except Exception:  # noqa: BLE001 - a missing file or refused token: the download that follows names it
            continue
        etag = (meta.etag or "").strip('"')
        mine = [p for p in partials if p.name.startswith(f"{etag}.")] if etag else []
        if not mine or (blobs / etag).exists() or meta.size is None:
            continue
        largest = max(mine, key=lambda p: p.stat().st_size)
        start = _resume_one(largest, blobs / etag, locks / f"{etag}.lock", meta, token)
        if start is not None:
            resumed[name] = start
        else:
            kept.add(largest)
    for partial in partials:  # the others: a changed file's, a smaller copy, one that failed its check
        if partial.exists() and partial not in kept:
            _delete_if_unheld(partial, locks / f"{partial.name.split('.', 1)[0]}.lock")
    return resumed


def _resume_one(partial: Path, blob: Path, lock_path: Path, meta, token) -> Optional[int]:
    """Continues ``partial`` into ``blob`` under the file's lock; the byte it resumed from, or None."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(lock_path), timeout=0):
            start = partial.stat().st_size
            if start < meta.size:
                headers = build_hf_headers(token=token, library_name=LIBRARY)
                with partial.open("ab") as file:
                    http_get(meta.location, file, resume_size=start, headers=headers, expected_size=meta.size,
                             displayed_filename=blob.name[:12])
            if _whole(partial, meta.size, meta.etag):
                os.replace(partial, blob)
                return start
            partial.unlink(missing_ok=True)  # not the file the Hub holds: fetched again from byte 0
    except Timeout:  # another process is downloading it now
        return None
    except (OSError, *CONNECTION_ERRORS):
        return None  # the download that follows fetches it whole, or says why it cannot
    return None


def _whole(path: Path, size: int, etag: Optional[str]) -> bool:
    """Whether ``path`` is the file the Hub lists: its size, and the digest its ETag is (an LFS file's SHA-256, a
    git file's blob id: SHA-1 of ``blob <size>\\0`` and the bytes); an ETag of another form is checked by size."""
    if path.stat().st_size != size:
        return False
    etag = (etag or "").strip('"')
    if _SHA256.fullmatch(etag):
        digest = hashlib.sha256()
    elif _GIT_BLOB.fullmatch(etag):
        digest = hashlib.sha1(b"blob %d\0" % size)
    else:
        return True
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest() == etag


def _delete_if_unheld(partial: Path, lock_path: Path) -> None:
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock_path), timeout=0):
            partial.unlink(missing_ok=True)
    except (Timeout, OSError):  # being downloaded now, or not ours to delete: left alone
        pass
