"""The format of an activation cache directory and the checks it passes before anything is read from it.

Legend: B batch.

A cache directory holds ``shard-00000.safetensors``, ``shard-00001.safetensors``, ... (each the activations of a run
of rows, every hook's tensor [rows, ...]) and ``index.json`` (the hook names, each hook's full shape [B, ...] and
dtype, each shard's row range, and the model's sizes). ``read_index`` opens one: the index's fields
(``check_index``), the shard files named inside the directory and not linked from outside it, and every shard's
header against the index (``check_shard_headers``), before any tensor is read. ``workbench.cache_store`` writes
caches and reads them (``load_cache``, the lazy ``ActivationCache``, ``read_rows``) through these.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

import torch
from safetensors import SafetensorError, safe_open

from workbench.errors import InputError
from workbench.safe_files import inside

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


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_index(index_path: Path, index: dict[str, Any]) -> None:
    """Refuses, with an ``InputError`` naming the field, an index that is not what ``ShardWriter.finish``
    writes: every field present and typed, a shape [rows, ...] and a dtype for each name, shard files
    named inside the directory, and shard row ranges covering rows 0..rows exactly once, in order.

    Example:
        >>> check_index(Path("runs/cache/index.json"), {"rows": 2, "names": [], "shapes": {}, "dtypes": {},
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


def read_index(path: Union[str, Path]) -> dict[str, Any]:
    """The checked index of the cache directory ``path``: refused (``InputError``, or ``CheckpointError`` for a
    shard linked from outside the directory) unless it is what ``ShardWriter.finish`` writes, every shard it names
    is a file inside the directory, and each shard's header holds what the index says. No tensor is read.

    Example:
        >>> import shutil, tempfile
        >>> directory = tempfile.mkdtemp()
        >>> _ = model.run_with_cache(tokens, cache_dir=directory, names_filter="hook_embed")
        >>> index = read_index(directory)
        >>> index["rows"], index["shapes"]["hook_embed"], [shard["rows"] for shard in index["shards"]]
        (1, [1, 14, 128], [[0, 1]])
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
    check_index(index_path, index)
    missing = [shard["file"] for shard in index["shards"] if not (directory / shard["file"]).is_file()]
    if missing:
        raise InputError(f"the activation cache {str(directory)!r} lacks its shard(s) {missing}")
    for shard in index["shards"]:  # a shard linked from outside the directory is refused before it is opened
        inside(directory, shard["file"], must_exist=True, what="activation cache")
    check_shard_headers(directory, index)
    return index


def check_shard_headers(directory: Path, index: dict[str, Any]) -> None:
    """Reads each shard's header only (no tensor) and refuses a shard that lacks a hook or holds it in
    another shape or dtype than the index says (copying it would broadcast, cast or leave rows unset).

    Example:
        >>> import tempfile
        >>> directory = Path(tempfile.mkdtemp())
        >>> (directory / "shard-00000.safetensors").write_bytes(b"not safetensors") and None
        >>> check_shard_headers(directory, {"names": [], "shards": [{"file": "shard-00000.safetensors", "rows": [0, 1]}]})
        Traceback (most recent call last):
        workbench.errors.InputError: '...shard-00000.safetensors': unreadable shard of the activation cache (...)
    """
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
