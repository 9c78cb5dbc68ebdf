"""Activation caches on disk: safetensors shards written one batch of rows at a time, and a lazy
``ActivationCache`` over them that reads one hook's tensors only when that hook is asked for.

Legend: B batch.

A cache directory holds ``shard-00000.safetensors``, ``shard-00001.safetensors``, ... (each the
activations of a run of rows, every hook's tensor [rows, ...]) and ``index.json`` (the hook names,
each hook's full shape [B, ...] and dtype, each shard's row range, and the model's sizes; the format and
its checks are ``workbench.cache_index``). The index is written last, so a directory without one is not a
finished cache. ``ShardWriter`` writes them (``Decoder.run_with_cache(cache_dir=...)`` uses it);
``load_cache`` opens one again, checked whole before anything is read; its ``ShardedActivations`` read a hook
whole (``cache[name]``) or a range of rows of several hooks (``read_rows``: what SAE training streams).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor
from transformer_lens import ActivationCache

# the format's names, re-exported: callers import them from here
from workbench.cache_index import (FORMAT, INDEX_FIELDS, INDEX_NAME, MODEL_SIZES, SAFETENSORS_DTYPES, VERSION,
                                   is_plain_file_name, read_index, shard_name)
from workbench.errors import InputError
from workbench.host import DecoderHost

__all__ = ["FORMAT", "INDEX_FIELDS", "INDEX_NAME", "MODEL_SIZES", "SAFETENSORS_DTYPES", "VERSION", "ShardWriter",
           "ShardedActivations", "is_plain_file_name", "load_cache", "shard_name"]


class ShardWriter:
    """Writes a cache directory one batch of rows at a time; ``abort()`` removes everything it wrote.

    ``directory`` must not exist (it is created, parents too) or be an empty directory: a
    non-empty one, a cache of ours included, is an ``InputError`` naming it, so nothing is ever
    overwritten. Each shard is written under a temporary name and renamed when complete.

    Example:
        >>> import shutil, tempfile
        >>> directory = Path(tempfile.mkdtemp()) / "cache"
        >>> writer = ShardWriter(directory, model)
        >>> resid = cache["blocks.0.hook_resid_post"]                  # [1, 14, 128]: one row
        >>> writer.write(0, 1, {"blocks.0.hook_resid_post": resid})
        >>> writer.write(1, 2, {"blocks.0.hook_resid_post": resid})
        >>> writer.finish(rows=2) == directory
        True
        >>> sorted(path.name for path in directory.iterdir())
        ['index.json', 'shard-00000.safetensors', 'shard-00001.safetensors']
        >>> wb.load_cache(directory)["blocks.0.hook_resid_post"].shape
        torch.Size([2, 14, 128])
        >>> shutil.rmtree(directory.parent)
    """

    def __init__(self, directory: Union[str, Path], model: DecoderHost):
        self.directory = Path(directory)
        self.model = model
        if self.directory.exists() and not self.directory.is_dir():
            raise InputError(f"cache_dir {str(self.directory)!r} is a file, not a directory")
        if self.directory.is_dir() and any(self.directory.iterdir()):
            what = "an activation cache already" if (self.directory / INDEX_NAME).is_file() else "other files"
            raise InputError(f"cache_dir {str(self.directory)!r} is not empty (it holds {what}): give a new or "
                             "empty directory, or remove this one first")
        # the directories this call creates, deepest first (removed in this order by abort)
        self.created = [p for p in (self.directory, *self.directory.parents) if not p.exists()]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shards: list[dict[str, Any]] = []
        self.entries: Optional[dict[str, tuple[list[int], torch.dtype]]] = None  # name -> (shape of one row, dtype)
        self.written: list[Path] = []

    def write(self, start: int, stop: int, activations: dict[str, Tensor]) -> None:
        """Writes rows ``start:stop`` of every hook (each tensor [stop - start, ...]) as the next shard.

        Example:
            >>> import tempfile
            >>> writer = ShardWriter(Path(tempfile.mkdtemp()) / "cache", model)
            >>> writer.write(0, 1, {"hook_embed": cache["hook_embed"]})
            >>> writer.shards
            [{'file': 'shard-00000.safetensors', 'rows': [0, 1]}]
            >>> writer.abort()
        """
        entries = {name: (list(t.shape[1:]), t.dtype) for name, t in activations.items()}
        if self.entries is None:
            self.entries = entries
        elif entries != self.entries:
            raise InputError(f"rows {start}:{stop} cached other hooks or shapes than the first rows: "
                             f"{sorted(set(entries) ^ set(self.entries)) or 'same names, other shapes'}")
        final = self.directory / shard_name(len(self.shards))
        temporary = final.with_name(final.name + ".tmp")
        self.written += [temporary, final]
        save_file(_unshared_cpu_tensors(activations), str(temporary))
        os.replace(temporary, final)
        self.shards.append({"file": final.name, "rows": [start, stop]})

    def finish(self, rows: int) -> Path:
        """Writes ``index.json`` (atomically) and returns the directory.

        Example:
            >>> import shutil, tempfile
            >>> writer = ShardWriter(tempfile.mkdtemp(), model)
            >>> writer.write(0, 1, {"hook_embed": cache["hook_embed"]})
            >>> directory = writer.finish(rows=1)
            >>> json.loads((directory / INDEX_NAME).read_text())["shapes"]
            {'hook_embed': [1, 14, 128]}
            >>> shutil.rmtree(directory)
        """
        entries = self.entries or {}
        index = {
            "format": FORMAT, "version": VERSION, "rows": rows,
            "names": list(entries),
            "shapes": {name: [rows, *shape] for name, (shape, _) in entries.items()},
            "dtypes": {name: str(dtype).removeprefix("torch.") for name, (_, dtype) in entries.items()},
            "shards": self.shards,
            "model": {size: getattr(self.model.cfg, size) for size in MODEL_SIZES},
        }
        final = self.directory / INDEX_NAME
        temporary = final.with_name(final.name + ".tmp")
        self.written += [temporary, final]
        temporary.write_text(json.dumps(index, indent=1), encoding="utf-8")
        os.replace(temporary, final)
        return self.directory

    def abort(self) -> None:
        """Removes every file this writer wrote and the directories it created (if left empty).

        Example:
            >>> import tempfile
            >>> directory = Path(tempfile.mkdtemp()) / "runs" / "cache"
            >>> writer = ShardWriter(directory, model)
            >>> writer.write(0, 1, {"hook_embed": cache["hook_embed"]})
            >>> writer.abort()
            >>> directory.parent.exists()   # "runs" was made by the writer, so it went too
            False
        """
        for path in self.written:
            path.unlink(missing_ok=True)
        for directory in self.created:
            try:
                directory.rmdir()
            except OSError:  # not empty: something else wrote there meanwhile
                break


def _unshared_cpu_tensors(activations: dict[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous CPU tensors no two of which share storage (safetensors refuses shared ones; two hook
    points can cache one tensor, e.g. ``blocks.0.hook_resid_post`` and ``blocks.1.hook_resid_pre``)."""
    out, seen = {}, set()
    for name, tensor in activations.items():
        tensor = tensor.detach().to("cpu").contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


class ShardedActivations(MutableMapping):
    """A mapping hook name -> activation [B, ...] backed by the shards of a cache directory: reading
    a name reads only that hook's tensor from each shard (into one preallocated tensor on
    ``device``); nothing is kept after it is returned. Names, ``in`` and ``len`` read the index only.

    Values set on it (TransformerLens's ``compute_head_results`` stores some) live in memory beside
    the shards; deleting a stored name hides it. Nothing is ever written back to disk.

    Example:
        >>> import shutil, tempfile
        >>> directory = tempfile.mkdtemp()
        >>> _ = model.run_with_cache(tokens, cache_dir=directory, names_filter="blocks.0.hook_resid_post")
        >>> index = json.loads((Path(directory) / INDEX_NAME).read_text())
        >>> activations = ShardedActivations(directory, index, torch.device("cpu"))
        >>> activations
        ShardedActivations('...', 1 hooks, 1 rows)
        >>> activations["blocks.0.hook_resid_post"].shape   # read from the shards now
        torch.Size([1, 14, 128])
        >>> shutil.rmtree(directory)
    """

    def __init__(self, directory: Union[str, Path], index: dict[str, Any], device: torch.device):
        self.directory = Path(directory)
        self.index = index
        self.device = device
        self._stored = {name: None for name in index["names"]}  # ordered set of names still on disk
        self._in_memory: dict[str, Tensor] = {}

    def __getitem__(self, name: str) -> Tensor:
        if isinstance(name, str) and name in self._in_memory:
            return self._in_memory[name]
        if not (isinstance(name, str) and name in self._stored):
            raise KeyError(name)
        dtype = getattr(torch, self.index["dtypes"][name])
        out = torch.empty(self.index["shapes"][name], dtype=dtype, device=self.device)
        for shard in self.index["shards"]:
            start, stop = shard["rows"]
            path = self.directory / shard["file"]
            with safe_open(str(path), framework="pt", device="cpu") as file:
                tensor = file.get_tensor(name)
            if tensor.shape != out[start:stop].shape or tensor.dtype != dtype:  # the file changed since load_cache
                raise InputError(f"{str(path)!r}: tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, but the index "
                                 f"says {dtype} {list(out[start:stop].shape)}")
            out[start:stop].copy_(tensor)
        return out

    def __setitem__(self, name: str, value: Tensor) -> None:
        self._in_memory[name] = value

    def __delitem__(self, name: str) -> None:
        if name in self._in_memory:
            del self._in_memory[name]
        elif name in self._stored:
            del self._stored[name]
        else:
            raise KeyError(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return isinstance(name, str) and (name in self._in_memory or name in self._stored)

    def __iter__(self) -> Iterator[str]:
        yield from self._stored
        yield from (name for name in self._in_memory if name not in self._stored)

    def __len__(self) -> int:
        return len(self._stored) + sum(name not in self._stored for name in self._in_memory)

    def __repr__(self) -> str:
        return f"ShardedActivations({str(self.directory)!r}, {len(self)} hooks, {self.index['rows']} rows)"

    def read_rows(self, names: Sequence[str], start: int, stop: int) -> dict[str, Tensor]:
        """Rows ``start:stop`` of each stored hook in ``names`` ([stop - start, ...], on ``device``), reading only
        those rows of the shards that hold them. Each shard's header is checked against the index before its rows
        are read (a shard changed since ``load_cache`` is refused); a name not stored or rows outside
        ``0:rows`` are an ``InputError`` naming them.

        Example:
            >>> import shutil, tempfile
            >>> directory = tempfile.mkdtemp()
            >>> _ = model.run_with_cache(tokens.repeat(3, 1), cache_dir=directory, names_filter="hook_embed",
            ...                          batch_size=2, progress=False)               # shards of rows 0:2 and 2:3
            >>> activations = wb.load_cache(directory).cache_dict
            >>> rows = activations.read_rows(["hook_embed"], 1, 3)["hook_embed"]    # from both shards
            >>> rows.shape, torch.equal(rows, activations["hook_embed"][1:3])
            (torch.Size([2, 14, 128]), True)
            >>> activations.read_rows(["hook_embed"], 2, 4)
            Traceback (most recent call last):
            workbench.errors.InputError: rows 2:4 of the activation cache '...' are not within its 3 rows
            >>> shutil.rmtree(directory)
        """
        unknown = [name for name in names if not (isinstance(name, str) and name in self._stored)]
        if unknown:
            raise InputError(f"the activation cache {str(self.directory)!r} holds no activations of {unknown} (it has "
                             f"{list(self._stored)})")
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= self.index["rows"]):
            raise InputError(f"rows {start}:{stop} of the activation cache {str(self.directory)!r} are not within its "
                             f"{self.index['rows']} rows")
        parts: dict[str, list[Tensor]] = {name: [] for name in names}
        for shard in self.index["shards"]:
            first, last = shard["rows"]
            low, high = max(start, first), min(stop, last)
            if low >= high:
                continue
            path = self.directory / shard["file"]
            try:
                with safe_open(str(path), framework="pt", device="cpu") as file:
                    for name in names:
                        view = file.get_slice(name)
                        found = (list(view.get_shape()), SAFETENSORS_DTYPES.get(view.get_dtype()))
                        expected = ([last - first, *self.index["shapes"][name][1:]],
                                    getattr(torch, self.index["dtypes"][name]))
                        if found != expected:  # the file changed since load_cache checked it
                            raise InputError(f"{str(path)!r}: tensor {name!r} is {found[1]} {found[0]}, but the index "
                                             f"says {expected[1]} {expected[0]} (the file changed)")
                        parts[name].append(view[low - first:high - first])
            except (SafetensorError, OSError) as error:
                raise InputError(f"{str(path)!r}: unreadable shard of the activation cache ({error})") from error
        return {name: self._joined(name, tensors, stop - start) for name, tensors in parts.items()}

    def _joined(self, name: str, tensors: list[Tensor], n_rows: int) -> Tensor:
        if not tensors:  # an empty range
            return torch.empty([n_rows, *self.index["shapes"][name][1:]], dtype=getattr(torch, self.index["dtypes"][name]),
                               device=self.device)
        return torch.cat(tensors).to(self.device)

    def nbytes(self) -> int:
        """Bytes of every stored hook's tensor together (what loading them all would take), from the index.

        Example:
            >>> index = {"names": ["hook_embed"], "shapes": {"hook_embed": [1, 14, 128]},
            ...          "dtypes": {"hook_embed": "float32"}}
            >>> ShardedActivations("runs/cache", index, torch.device("cpu")).nbytes()   # no file is read
            7168
            >>> 1 * 14 * 128 * torch.float32.itemsize
            7168
        """
        return sum(math.prod(self.index["shapes"][name]) * getattr(torch, self.index["dtypes"][name]).itemsize
                   for name in self._stored)


def load_cache(path: Union[str, Path], model: Optional[DecoderHost] = None,
               device: Union[None, str, torch.device] = None) -> ActivationCache:
    """Opens a cache directory written by ``model.run_with_cache(..., cache_dir=path)`` as a lazy
    ``ActivationCache``: ``cache[name]`` reads that hook's tensors from the shards when asked.

    ``model`` is what TransformerLens's helpers read (``accumulated_resid``, ``cache["pattern", -1]``,
    ``apply_ln_to_stack``, ...); plain names and ``cache["pattern", 0]`` work without one. A model
    of other sizes than the one that wrote the cache is an ``InputError``. ``device``: where the
    tensors load (default: the model's device, else the CPU).

    Example:
        >>> import shutil, tempfile
        >>> directory = tempfile.mkdtemp()
        >>> _ = model.run_with_cache(tokens, cache_dir=directory)   # every hook, written to disk
        >>> cache = wb.load_cache(directory, model)
        >>> cache["pattern", 0].shape                               # layer 0's pattern, read now
        torch.Size([1, 4, 14, 14])
        >>> shutil.rmtree(directory)
    """
    directory = Path(path)
    index = read_index(directory)
    if model is not None:
        different = {size: (written, getattr(model.cfg, size)) for size, written in index["model"].items()
                     if getattr(model.cfg, size, written) != written}
        if different:
            raise InputError(f"the activation cache {str(directory)!r} was written by a model of other sizes: "
                             + ", ".join(f"{size} {was} there, {now} here" for size, (was, now) in different.items()))
    if device is None:
        device = model.cfg.device if model is not None else "cpu"
    return ActivationCache(ShardedActivations(directory, index, torch.device(device)), model, has_batch_dim=True)


