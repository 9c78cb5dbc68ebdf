"""Refusing a download that would not fit, before any byte of it is fetched (huggingface_hub only warns).

Counted: the files still to download (those already in the cache cost nothing), against the free
space of the disk that holds the cache.
"""

from __future__ import annotations

from pathlib import Path
from shutil import disk_usage

from workbench.hub.errors import HubDiskSpaceError


def readable_bytes(n_bytes: float) -> str:
    """A byte count in binary units.

    Example:
        >>> readable_bytes(1536), readable_bytes(3 * 2**30)
        ('1.5 KiB', '3.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n_bytes < 1024 or unit == "TiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024
    raise AssertionError("unreachable")


def check_disk_space(repo_id: str, to_download: dict[str, int], cache: Path) -> None:
    """Raises ``HubDiskSpaceError`` when ``to_download`` (file -> bytes) exceeds the free space where ``cache`` is.

    Example:
        >>> check_disk_space("org/name", {"model.safetensors": 10}, Path("."))   # ten bytes fit
        >>> check_disk_space("org/name", {"model.safetensors": 2**60}, Path("."))
        Traceback (most recent call last):
        ...
        workbench.hub.errors.HubDiskSpaceError: org/name: its files to download (model.safetensors) take 1048576.0 TiB, but the disk of the cache ...
    """
    needed = sum(to_download.values())
    if not needed:
        return
    place = _existing_ancestor(Path(cache))
    free = disk_usage(place).free
    if needed > free:
        names = ", ".join(sorted(to_download)[:6]) + (" ..." if len(to_download) > 6 else "")
        raise HubDiskSpaceError(
            f"{repo_id}: its files to download ({names}) take {readable_bytes(needed)}, but the disk of the cache "
            f"{cache} has {readable_bytes(free)} free; nothing was downloaded. Free space there, or pass "
            "cache_dir= (or set HF_HUB_CACHE) to a larger disk")


def _existing_ancestor(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
