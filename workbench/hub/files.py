"""Which of a repo's files a load reads, and nothing else: config, tokenizer, and one set of weights.

Weights, in order of preference: a safetensors shard index and the shards it names, ``model.safetensors``,
a pickle shard index and its shards, ``pytorch_model.bin``. Remote code (``modeling_*.py``, ``auto_map``),
READMEs, other frameworks' weights and duplicate checkpoints (``consolidated.safetensors``) are never
fetched. A GGUF load reads its one file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Collection, Optional

from workbench.errors import CheckpointError
from workbench.hub.errors import HubNotFoundError

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SAFETENSORS_INDEX, SAFETENSORS_SINGLE = "model.safetensors.index.json", "model.safetensors"
PICKLE_INDEX, PICKLE_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"
# Every file a load may read besides the weights and their shards (what to look for in a cache with no listing).
KNOWN_FILES = (*CONFIG_FILES, *TOKENIZER_FILES, SAFETENSORS_INDEX, SAFETENSORS_SINGLE, PICKLE_INDEX, PICKLE_SINGLE)
# A shard named by an index: a plain file name (used as an exact allow-pattern: no glob characters, no folders).
_PLAIN_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Wanted:
    """The files one load reads: ``files`` (all, to download), ``weights`` (the weight files among them)
    and whether those are pickles (``pytorch_model*.bin``, read with ``torch.load(weights_only=True)``)."""

    files: tuple[str, ...]
    weights: tuple[str, ...]
    pickled: bool


def wanted_files(listed: Collection[str], read_index: Callable[[str], dict], source: str,
                 gguf_file: Optional[str] = None) -> Wanted:
    """The files of a repo listing ``listed`` that a load reads; ``read_index(name)`` gives a shard index's
    JSON. A ``CheckpointError`` naming ``source`` when no weights we read are there.

    Example:
        >>> wanted_files(["README.md", "config.json", "model.safetensors", "modeling_evil.py",
        ...               "tokenizer.json", "flax_model.msgpack"], dict, "org/name").files
        ('config.json', 'tokenizer.json', 'model.safetensors')
        >>> wanted_files(["config.json", "model.gguf"], dict, "org/name", gguf_file="model.gguf").files
        ('model.gguf',)
    """
    listed = set(listed)
    if gguf_file is not None:
        if gguf_file not in listed:
            raise HubNotFoundError(f"{source}: no file {gguf_file!r} in the repo (GGUF files there: "
                                  f"{sorted(name for name in listed if name.endswith('.gguf'))})")
        return Wanted((gguf_file,), (gguf_file,), False)
    if "config.json" not in listed:
        raise CheckpointError(f"{source}: no config.json in the repo, so no model we can build "
                              f"(files: {sorted(listed)[:20]})")
    for index, single, pickled in ((SAFETENSORS_INDEX, SAFETENSORS_SINGLE, False), (PICKLE_INDEX, PICKLE_SINGLE, True)):
        if index in listed:
            weights = (index, *shards_of(read_index(index), f"{source}/{index}"))
            break
        if single in listed:
            weights = (single,)
            break
    else:
        raise CheckpointError(f"{source}: no weights we read ({SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX} and its shards, "
                              f"or {PICKLE_SINGLE}); files: {sorted(listed)[:20]}")
    others = tuple(name for name in (*CONFIG_FILES, *TOKENIZER_FILES) if name in listed)
    return Wanted((*others, *weights), weights, pickled)


def shards_of(index: dict, source: str) -> tuple[str, ...]:
    """The shard files a shard index names, each a plain file name (a hostile index is refused).

    Example:
        >>> shards_of({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors",
        ...                           "c": "model-1.safetensors"}}, "index.json")
        ('model-1.safetensors', 'model-2.safetensors')
        >>> shards_of({"weight_map": {"a": "../../etc/passwd"}}, "index.json")
        Traceback (most recent call last):
        ...
        workbench.errors.CheckpointError: index.json: weight_map['a'] = '../../etc/passwd' is not a plain file name beside the index
    """
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{source}: a shard index needs a non-empty 'weight_map' of tensor name -> file name")
    for name, file_name in weight_map.items():
        if not isinstance(file_name, str) or not _PLAIN_FILE.fullmatch(file_name) or ".." in file_name:
            raise CheckpointError(f"{source}: weight_map[{name!r}] = {file_name!r} is not a plain file name beside the index")
    return tuple(sorted(set(weight_map.values())))
