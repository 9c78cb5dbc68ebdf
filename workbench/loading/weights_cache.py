"""A converted checkpoint kept on disk, so a model whose loader converts its weights (a GGUF file's dequantised
blocks) opens in about a second after its first load.

``load_converted(source, converter, convert)`` returns what ``convert()`` returns, a ``Converted`` (the
``ModelConfig``, the tokenizer and the tensors, ready for ``build_model``), from the cache when an entry made
from this very source by this very converter is there and intact, else by calling ``convert()`` and writing
the entry for next time. Why the config and the tokenizer too: reading SmolLM2's GGUF metadata and rebuilding
its 49k-token tokenizer alone take longer than the whole cached load.

One safetensors file per source under ``cache_directory()/weights/`` (``workbench.cache_dir``), memory-mapped
when read. Its key, stored in the file and compared before use, is:

- the source's identity: its resolved path, size, ``mtime_ns`` and a fingerprint of its bytes (SHA-256 of the
  first and last MiB and of 16 evenly spaced 64 KiB blocks), so a rewritten file is converted again;
- the converter: its name and every option that changes its output (``converter``), ``FORMAT_VERSION`` (bumped
  by hand when a conversion changes) and a digest of the conversion code's source (``CONVERSION_CODE``: any
  edit of ``workbench/loading/``, ``config.py`` or ``tokenizer.py`` converts again, bump or no bump).

Its integrity: the SHA-256 of its metadata and of every tensor's name, dtype, shape and bytes is stored in its
metadata and checked on a read (~0.4-2 s of CPU for SmolLM2's 540 MB), so a truncated, tampered or foreign
file is never loaded: it is converted again and replaced. A passing check of an entry unchanged for two seconds
leaves a stamp (``workbench.loading.entry_stamps``): a later read of the same unchanged file (same inode, size,
mtime and ctime, which any write moves) skips the hash (integrity, not authenticity: whoever can write the
cache folder could write a matching digest, as they could replace the checkpoint itself). Entries are written
through ``workbench.safe_files.save_files`` (a temporary renamed into place when complete), so two processes
loading at once leave one good file; a cache that cannot be written (read-only, full disk) costs a warning and
the slow path, nothing more. Off for one load with ``wb.load_model(..., weights_cache=False)``, for every load
with ``WORKBENCH_WEIGHTS_CACHE=0``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import tokenizers
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from workbench.cache_dir import cache_directory
from workbench.config import ModelConfig
from workbench.loading.entry_stamps import file_state, prune_stamps, remember_verified, was_verified
from workbench.safe_files import save_files
from workbench.tokenizer import SpecialTokens, Tokenizer

__all__ = ["Converted", "load_converted", "build_converted", "cache_enabled", "entry_path", "WEIGHTS_CACHE_ENV", "FORMAT_VERSION"]

WEIGHTS_CACHE_ENV = "WORKBENCH_WEIGHTS_CACHE"  # "0", "false", "off" or "no": never read or write the cache
FORMAT_VERSION = 1  # bump when a conversion or this file's layout changes in a way the code digest cannot see
FORMAT_TAG = "workbench-weights-cache"
SUBDIRECTORY = "weights"
# The code whose output an entry holds: an edit of any of it makes every entry stale.
CONVERSION_CODE = ("workbench.loading", "workbench.config", "workbench.tokenizer")
HEAD_TAIL_BYTES = 1 << 20
SAMPLES, SAMPLE_BYTES = 16, 1 << 16
STALE_TEMPORARY_SECONDS = 3600  # a temporary this old was left by a killed writer
KEEP_PER_SOURCE = 2  # entries kept per source file: the newest, and one other
HASH_THREADS = min(4, os.cpu_count() or 1)
_OFF = ("0", "false", "off", "no")
_LOCKS: dict[Path, threading.Lock] = {}  # one per entry: threads of one process convert a source once
_LOCKS_GUARD = threading.Lock()


class Converted(NamedTuple):
    """What a loader's conversion gives ``build_model``: the architecture, the tokenizer (or None) and the
    tensors under our names."""

    config: ModelConfig
    tokenizer: Optional[Tokenizer]
    tensors: dict[str, Tensor]


def cache_enabled(choice: Optional[bool] = None) -> bool:
    """The caller's choice, or (None) on unless ``$WORKBENCH_WEIGHTS_CACHE`` is "0", "false", "off" or "no".

    Example:
        >>> cache_enabled(False), cache_enabled(True)
        (False, True)
    """
    if choice is not None:
        return bool(choice)
    return os.environ.get(WEIGHTS_CACHE_ENV, "1").strip().lower() not in _OFF


def load_converted(source: Path, converter: str, convert: Callable[[], Converted], *,
                   check: Callable[[ModelConfig], Any] = lambda cfg: None,
                   enabled: Optional[bool] = None) -> Converted:
    """``convert()``'s result for the file ``source``, from the cache when an intact entry made from this file by
    this ``converter`` (its name and every option that changes its output) is there, else converted and
    written for next time. ``check(cfg)`` runs on a cached config before its tensors are read (``convert``
    checks its own), so a bad load option fails first either way.

    Example:
        >>> import tempfile
        >>> from unittest import mock
        >>> source = Path(tempfile.mkdtemp()) / "weights.bin"
        >>> _ = source.write_bytes(b"any file the conversion reads")
        >>> calls = []
        >>> def convert():
        ...     calls.append(1)
        ...     return Converted(model.config, model.tokenizer, {"embed.W_E": model.embed.W_E.detach().clone()})
        >>> with mock.patch.dict(os.environ, {"WORKBENCH_CACHE_DIR": tempfile.mkdtemp()}):
        ...     first = load_converted(source, "demo", convert)
        ...     again = load_converted(source, "demo", convert)    # read from the cache: not converted again
        >>> len(calls), torch.equal(again.tensors["embed.W_E"], first.tensors["embed.W_E"])
        (1, True)
        >>> again.config == model.config, again.tokenizer.encode("import os") == model.tokenizer.encode("import os")
        (True, True)
    """
    config, parse_tokenizer, tensors = _entry_or_conversion(source, converter, convert, check, enabled)
    return Converted(config, parse_tokenizer(), tensors)


def build_converted(source: Path, converter: str, convert: Callable[[], Converted],
                    build: Callable[[Converted], Any], *, check: Callable[[ModelConfig], Any] = lambda cfg: None,
                    enabled: Optional[bool] = None) -> Any:
    """``build(load_converted(...))``, the model a loader makes of the conversion, with its ``tokenizer``; from a
    cached entry the tokenizer (a large JSON the tokenizers library parses without the GIL) is parsed on a
    thread while ``build`` runs without it, and set on the built model after.

    Example:
        >>> import tempfile
        >>> from unittest import mock
        >>> from workbench.loading.build import build_model
        >>> source = Path(tempfile.mkdtemp()) / "weights.bin"
        >>> _ = source.write_bytes(b"any file the conversion reads")
        >>> convert = lambda: Converted(model.config, model.tokenizer, dict(model.state_dict()))
        >>> build = lambda converted: build_model(*converted, str(source))
        >>> with mock.patch.dict(os.environ, {"WORKBENCH_CACHE_DIR": tempfile.mkdtemp()}):
        ...     first = build_converted(source, "demo", convert, build)
        ...     again = build_converted(source, "demo", convert, build)    # from the cache
        >>> torch.equal(again(tokens), first(tokens)), again.tokenizer.encode("x y") == model.tokenizer.encode("x y")
        (True, True)
    """
    config, parse_tokenizer, tensors = _entry_or_conversion(source, converter, convert, check, enabled)
    with ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer = pool.submit(parse_tokenizer)
        built = build(Converted(config, None, tensors))
        built.tokenizer = tokenizer.result()
    return built


def _entry_or_conversion(source: Path, converter: str, convert: Callable[[], Converted],
                         check: Callable[[ModelConfig], Any], enabled: Optional[bool]) -> tuple:
    """(config, a function giving the tokenizer, tensors): the intact cached entry's, else ``convert()``'s (the
    entry written for next time)."""
    try:
        key = entry_key(source, converter) if cache_enabled(enabled) else None
    except OSError:  # no such file, or unreadable: the loader's own error says so
        key = None
    if key is None:
        converted = convert()
    else:
        path = entry_path(source, key)
        with _lock_for(path):
            cached = _read_entry(path, key, check)
            if cached is not None:
                return cached
            converted = convert()
            _write_entry(path, key, converted)
    return converted.config, lambda: converted.tokenizer, converted.tensors


def entry_key(source: Path, converter: str) -> dict[str, Any]:
    """What an entry is made from: ``source``'s identity, the converter and the conversion code (see the module).

    Example:
        >>> import tempfile
        >>> source = Path(tempfile.mkdtemp()) / "weights.bin"
        >>> _ = source.write_bytes(b"abc")
        >>> key = entry_key(source, "demo")
        >>> key["source"]["size"], key["converter"], key["format"] == FORMAT_VERSION
        (3, 'demo', True)
    """
    resolved = Path(source).resolve()
    stat = resolved.stat()
    return {"format": FORMAT_VERSION, "converter": converter, "code": _code_digest(CONVERSION_CODE),
            "source": {"path": str(resolved), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                       "fingerprint": _fingerprint(resolved, stat.st_size)}}


def entry_path(source: Path, key: dict[str, Any]) -> Path:
    """The entry's file: ``cache_directory()/weights/<source name>-<path digest>-<key digest>.safetensors``
    (the path digest groups a source's entries, so a stale one is removed when a new one is written).

    Example:
        >>> path = entry_path(Path("model.gguf"), {"any": "key"})
        >>> path.parent == cache_directory() / "weights", path.name.startswith("model.gguf-"), path.suffix
        (True, True, '.safetensors')
    """
    return cache_directory() / SUBDIRECTORY / f"{_source_prefix(source)}{_digest(_canonical(key))[:24]}.safetensors"


def _source_prefix(source: Path) -> str:
    resolved = Path(source).resolve()
    return f"{resolved.name}-{_digest(str(resolved))[:12]}-"


def _lock_for(path: Path) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(path, threading.Lock())


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _fingerprint(path: Path, size: int) -> str:
    """SHA-256 of the first and last MiB and of ``SAMPLES`` evenly spaced blocks: a few MiB read, whatever the size."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        offsets = [0, max(0, size - HEAD_TAIL_BYTES)] + [size * i // (SAMPLES + 1) for i in range(1, SAMPLES + 1)]
        for offset, length in zip(offsets, [HEAD_TAIL_BYTES] * 2 + [SAMPLE_BYTES] * SAMPLES):
            file.seek(offset)
            digest.update(file.read(length))
    return digest.hexdigest()


@lru_cache(maxsize=None)
def _code_digest(modules: tuple[str, ...]) -> str:
    """SHA-256 of the source of ``modules`` (a package: every .py file under it), by path relative to its root."""
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        files = [(Path(spec.origin).name, Path(spec.origin))] if spec is not None and not roots and spec.origin else []
        for root in roots:
            files += [(str(path.relative_to(root)), path) for path in sorted(Path(root).rglob("*.py"))]
        for relative, path in files:
            digest.update(f"{name}/{relative}\0".encode() + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _content_digest(metadata: dict[str, str], tensors: dict[str, Tensor],
                    meanwhile: Callable[[], Any] = lambda: None) -> tuple[str, Any]:
    """SHA-256 of the metadata (the digest itself left out) and of every tensor's name, dtype, shape and the
    SHA-256 of its bytes; and what ``meanwhile()`` returns, run while the tensors are hashed on threads
    (hashlib lets go of the GIL: the check costs half its CPU time in wall time on two free cores)."""
    names = sorted(tensors)
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        pending = [pool.submit(_bytes_digest, tensors[name]) for name in names]
        result = meanwhile()
        parts = [future.result() for future in pending]
    digest = hashlib.sha256(_canonical({k: v for k, v in metadata.items() if k != "digest"}).encode())
    for name, part in zip(names, parts):
        digest.update(f"\0{name}|{tensors[name].dtype}|{tuple(tensors[name].shape)}|{part}".encode())
    return digest.hexdigest(), result


def _bytes_digest(tensor: Tensor) -> str:
    flat = tensor.detach().contiguous().reshape(-1)
    return hashlib.sha256(memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b"").hexdigest()


def _metadata(key: dict[str, Any], converted: Converted) -> dict[str, str]:
    tokenizer = converted.tokenizer
    return {"format": FORMAT_TAG, "key": _canonical(key), "config": json.dumps(converted.config.to_dict()),
            "tokenizer": "" if tokenizer is None else tokenizer.backend.to_str(),
            "specials": "" if tokenizer is None else json.dumps(asdict(tokenizer.specials))}


def _read_entry(path: Path, key: dict[str, Any], check: Callable[[ModelConfig], Any]) -> Optional[tuple]:
    """(config, a function parsing its tokenizer, tensors) of the entry at ``path`` if it is there, ours, made
    with ``key`` and intact; None (after a warning for a damaged one) otherwise. ``check`` runs on its config
    before the tensors are read; its errors propagate."""
    if not path.is_file():
        return None
    try:
        if path.is_symlink():  # never written by us (saves refuse links): not read through either
            raise ValueError("a symbolic link")
        with safe_open(str(path), framework="pt") as file:
            metadata = dict(file.metadata() or {})
        if metadata.get("format") != FORMAT_TAG or metadata.get("key") != _canonical(key):
            raise ValueError("made from another source or by another converter")
        config = ModelConfig.from_dict(json.loads(metadata["config"]))
    except Exception as problem:  # a file of any bytes at all: every failure means "convert again"
        return _damaged(path, problem)
    check(config)  # a bad load option is the caller's error, not the entry's
    try:
        state = file_state(path)  # before the bytes are read: a write after this moves the next load's state
        tensors = load_file(str(path))  # memory-mapped: pages are read as the digest and the model touch them
        parse_tokenizer = functools.partial(_tokenizer, metadata)
        if not was_verified(path, state, metadata.get("digest", "")):
            digest, tokenizer = _content_digest(metadata, tensors, meanwhile=parse_tokenizer)
            if digest != metadata.get("digest"):
                raise ValueError("its digest does not match its contents (truncated or modified)")
            remember_verified(path, state, metadata["digest"])
            parse_tokenizer = lambda: tokenizer  # parsed already, while the tensors were hashed
    except Exception as problem:
        return _damaged(path, problem)
    return config, parse_tokenizer, tensors


def _tokenizer(metadata: dict[str, str]) -> Optional[Tokenizer]:
    if not metadata["tokenizer"]:
        return None
    specials = SpecialTokens(**json.loads(metadata["specials"]))
    return Tokenizer(tokenizers.Tokenizer.from_str(metadata["tokenizer"]), specials)


def _damaged(path: Path, problem: Exception) -> None:
    warnings.warn(f"{path}: weights cache entry not used ({type(problem).__name__}: {problem}); converting "
                  "the checkpoint again", RuntimeWarning, stacklevel=4)
    return None


def _write_entry(path: Path, key: dict[str, Any], converted: Converted) -> None:
    """Writes the entry (atomically), then removes this source's stale entries and entries whose source is gone;
    an entry that cannot be written is a warning and nothing else."""
    try:
        tensors = _unshared(converted.tensors)
        metadata = _metadata(key, converted)
        if ModelConfig.from_dict(json.loads(metadata["config"])) != converted.config:
            raise ValueError("its config does not survive a round trip through JSON")
        metadata["digest"] = _content_digest(metadata, tensors)[0]
        needed = sum(t.numel() * t.element_size() for t in tensors.values()) + len(_canonical(metadata))
        path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path.parent).free
        if free < 2 * needed:  # leave room: a cache never fills the disk
            raise OSError(f"{free} bytes free, the entry needs {needed}")
        save_files(path.parent, {path.name: lambda temporary: save_file(tensors, str(temporary), metadata)},
                   what="weights cache")
    except Exception as problem:  # read-only or full disk, a link in the way ...: the load goes on without
        warnings.warn(f"{path}: weights cache not written ({type(problem).__name__}: {problem}); the next load "
                      "converts the checkpoint again", RuntimeWarning, stacklevel=4)
        return
    _prune(path)


def _unshared(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tensors, each contiguous and with storage of its own (safetensors refuses views of one storage, as a
    fused matrix split in three)."""
    seen: set[int] = set()
    result = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        result[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return result


def _prune(kept: Path) -> None:
    """Removes the older entries of ``kept``'s source but the newest other (two checkouts of different code may
    share a cache), entries whose source file is gone, and temporaries a killed writer left over an hour ago.
    Best effort: a file another process removed first is fine."""
    prefix = kept.name[:-len(kept.name.rsplit("-", 1)[1])]
    siblings = []
    try:
        others = list(kept.parent.iterdir())
    except OSError:
        return
    for other in others:
        try:
            if other.name.startswith(".") and other.name.endswith(".tmp"):
                if time.time() - other.stat().st_mtime > STALE_TEMPORARY_SECONDS:
                    other.unlink()
            elif other != kept and other.suffix == ".safetensors":
                if other.name.startswith(prefix):
                    siblings.append((other.stat().st_mtime_ns, other))
                elif not _source_exists(other):
                    other.unlink()
        except OSError:
            continue
    for _, other in sorted(siblings, reverse=True)[KEEP_PER_SOURCE - 1:]:
        try:
            other.unlink(missing_ok=True)
        except OSError:
            continue
    prune_stamps(kept.parent)


def _source_exists(entry: Path) -> bool:
    """Whether the source an entry names is still a file (True for a file that is not an entry: not ours)."""
    try:
        with safe_open(str(entry), framework="pt") as file:
            metadata = file.metadata() or {}
        if metadata.get("format") != FORMAT_TAG:
            return True
        return Path(json.loads(metadata["key"])["source"]["path"]).is_file()
    except Exception:
        return True  # unreadable: left for a reader to detect and replace
