"""Refusing a download that would not fit, before any byte of it is fetched (huggingface_hub only warns).

Counted: the files still to download (those already in the cache cost nothing), against the free
space of the disk that holds the cache. A model's sizes come from its repo listing (``resolve``);
single files (an SAE's config and weights) are sized by one ``HEAD`` each (``files_to_download``).
A download that was killed leaves its partial blob behind; ``workbench.hub.resume`` continues or deletes it
before the check.
"""

from __future__ import annotations

from pathlib import Path
from shutil import disk_usage
from typing import Optional

from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import RemoteEntryNotFoundError

from workbench.hub.errors import HubDiskSpaceError, hub_error
from workbench.memory import readable_bytes
from workbench.hub.resolve import CONNECTION_ERRORS, LIBRARY


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


def files_to_download(repo_id: str, names: list[str], revision: str, endpoint: str,
                      cache: Path) -> Optional[dict[str, int]]:
    """File -> bytes of the ``names`` the cache lacks at ``revision``, each sized by a ``HEAD`` on the Hub (no
    body fetched); None when the Hub cannot be reached (the download that follows says so, naming the files).

    Example:
        >>> files_to_download("org/name", [], "main", "https://huggingface.co", Path("/tmp/empty-cache"))
        {}
    """
    sizes: dict[str, int] = {}
    for name in names:
        if isinstance(try_to_load_from_cache(repo_id, name, cache_dir=str(cache), revision=revision), str):
            continue  # cached: costs nothing
        url = hf_hub_url(repo_id, name, revision=revision, endpoint=endpoint)
        try:
            sizes[name] = get_hf_file_metadata(url, library_name=LIBRARY, endpoint=endpoint).size or 0
        except CONNECTION_ERRORS:
            return None
        except RemoteEntryNotFoundError:
            continue  # no such file: the download that follows says so, and the cache records the answer
        except Exception as error:
            raise (hub_error(error, repo_id, revision, endpoint, name) or error) from error
    return sizes
