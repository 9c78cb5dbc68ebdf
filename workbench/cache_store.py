"""Activation caches on disk: safetensors shards written one batch of rows at a time, and a lazy
``ActivationCache`` over them that reads one hook's tensors only when that hook is asked for.

Legend: B batch.

A cache directory holds ``shard-00000.safetensors``, ``shard-00001.safetensors``, ... (each the
activations of a run of rows, every hook's tensor [rows, ...]) and ``index.json`` (the hook names,
each hook's full shape [B, ...] and dtype, each shard's row range, and the model's sizes). The index
is written last, so a directory without one is not a finished cache. ``ShardWriter`` writes them
(``Decoder.run_with_cache(cache_dir=...)`` uses it); ``load_cache`` opens one again.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor
from transformer_lens import ActivationCache

from workbench.errors import InputError
from workbench.host import DecoderHost


INDEX_NAME = "index.json"
FORMAT = "workbench-activation-cache"
VERSION = 1
MODEL_SIZES = ("n_layers", "d_model", "n_heads", "n_key_value_heads", "d_vocab")
INDEX_FIELDS = ("rows", "names", "shapes", "dtypes", "shards", "model")
# a safetensors header's dtype names, as torch dtypes (to check a shard holds what the index says)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def is_plain_file_name(name: Any) -> bool:
    """Whether ``name`` names a file directly inside a directory (no folder part, no "..", not absolute):
    what a file name read from an index on disk must be before it is opened or deleted.

    Example:
        >>> is_plain_file_name("shard-00000.safetensors"), is_plain_file_name("../x"), is_plain_file_name("/etc/passwd")
        (True, False, False)
    """
    return isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..")


def shard_name(number: int) -> str:
    """The file name of shard ``number``.

    Example:
        >>> shard_name(3)
        'shard-00003.safetensors'
    """
    return f"shard-{number:05d}.safetensors"


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
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        raise InputError(f"{str(directory)!r} is not an activation cache: it has no {INDEX_NAME} "
                         "(write one with model.run_with_cache(..., cache_dir=...))")
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise InputError(f"{str(index_path)!r} cannot be read as an activation cache index: {error}") from error
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise InputError(f"{str(index_path)!r} is not an activation cache index (no \"format\": \"{FORMAT}\")")
    _check_index(index_path, index)
    missing = [shard["file"] for shard in index["shards"] if not (directory / shard["file"]).is_file()]
    if missing:
        raise InputError(f"the activation cache {str(directory)!r} lacks its shard(s) {missing}")
    _check_shard_headers(directory, index)
    if model is not None:
        different = {size: (written, getattr(model.cfg, size)) for size, written in index["model"].items()
                     if getattr(model.cfg, size, written) != written}
        if different:
            raise InputError(f"the activation cache {str(directory)!r} was written by a model of other sizes: "
                             + ", ".join(f"{size} {was} there, {now} here" for size, (was, now) in different.items()))
    if device is None:
        device = model.cfg.device if model is not None else "cpu"
    return ActivationCache(ShardedActivations(directory, index, torch.device(device)), model, has_batch_dim=True)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_index(index_path: Path, index: dict[str, Any]) -> None:
    """Refuses, with an ``InputError`` naming the field, an index that is not what ``ShardWriter.finish``
    writes: every field present and typed, a shape [rows, ...] and a dtype for each name, shard files
    named inside the directory, and shard row ranges covering rows 0..rows exactly once, in order.

    Example:
        >>> _check_index(Path("runs/cache/index.json"), {"rows": 2, "names": [], "shapes": {}, "dtypes": {},
        ...              "model": {}, "shards": [{"file": "../x", "rows": [0, 2]}]})
        Traceback (most recent call last):
        ...
        workbench.errors.InputError: 'runs/cache/index.json': field 'shards[0].file' must be a file name inside the cache directory, got '../x'
    """
    def refuse(field: str, problem: str) -> InputError:
        return InputError(f"{str(index_path)!r}: field {field!r} {problem}")

    for field in INDEX_FIELDS:
        if field not in index:
            raise refuse(field, "is missing")
    rows, names = index["rows"], index["names"]
    if not _is_count(rows):
        raise refuse("rows", f"must be a whole number of rows, got {rows!r}")
    if not (isinstance(names, list) and all(isinstance(name, str) for name in names) and len(set(names)) == len(names)):
        raise refuse("names", "must be a list of distinct hook names")
    for field in ("shapes", "dtypes", "model"):
        if not isinstance(index[field], dict):
            raise refuse(field, "must be an object")
    for name in names:
        shape, dtype = index["shapes"].get(name), index["dtypes"].get(name)
        if not (isinstance(shape, list) and shape and all(_is_count(size) for size in shape) and shape[0] == rows):
            raise refuse(f"shapes[{name!r}]", f"must be [rows={rows}, ...] in whole numbers, got {shape!r}")
        if not (isinstance(dtype, str) and getattr(torch, dtype, None) in SAFETENSORS_DTYPES.values()):
            raise refuse(f"dtypes[{name!r}]", f"must name a torch dtype (e.g. 'float32'), got {dtype!r}")
    if not all(_is_count(size) for size in index["model"].values()):
        raise refuse("model", "must map each model size to a whole number")
    if not isinstance(index["shards"], list):
        raise refuse("shards", "must be a list")
    covered = 0
    for number, shard in enumerate(index["shards"]):
        file, span = (shard.get("file"), shard.get("rows")) if isinstance(shard, dict) else (None, None)
        if not is_plain_file_name(file):
            raise refuse(f"shards[{number}].file", f"must be a file name inside the cache directory, got {file!r}")
        if not (isinstance(span, list) and len(span) == 2 and all(_is_count(row) for row in span)
                and span[0] == covered and span[1] >= covered):
            raise refuse(f"shards[{number}].rows", f"must be [{covered}, stop] (the shards cover the rows once, "
                         f"in order), got {span!r}")
        covered = span[1]
    if covered != rows:
        raise refuse("shards", f"cover rows 0:{covered}, but field 'rows' is {rows}")


def _check_shard_headers(directory: Path, index: dict[str, Any]) -> None:
    """Reads each shard's header only (no tensor) and refuses a shard that lacks a hook or holds it in
    another shape or dtype than the index says (copying it would broadcast, cast or leave rows unset)."""
    for number, shard in enumerate(index["shards"]):
        path = directory / shard["file"]
        start, stop = shard["rows"]
        try:
            with safe_open(str(path), framework="pt", device="cpu") as file:
                held = set(file.keys())
                headers = {name: file.get_slice(name) for name in index["names"] if name in held}
                found = {name: (list(view.get_shape()), SAFETENSORS_DTYPES.get(view.get_dtype()))
                         for name, view in headers.items()}
        except (SafetensorError, OSError) as error:
            raise InputError(f"{str(path)!r}: unreadable shard of the activation cache ({error})") from error
        for name in index["names"]:
            expected = ([stop - start, *index["shapes"][name][1:]], getattr(torch, index["dtypes"][name]))
            if name not in found:
                raise InputError(f"{str(path)!r} holds no tensor {name!r} (listed in the index's field 'names')")
            if found[name] != expected:
                raise InputError(f"{str(path)!r}: tensor {name!r} is {found[name][1]} {found[name][0]}, but the index's "
                                 f"fields 'shapes', 'dtypes' and 'shards[{number}].rows' say {expected[1]} {expected[0]}")
