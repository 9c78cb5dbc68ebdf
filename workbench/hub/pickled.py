"""A repo with only pickled weights (``pytorch_model.bin``, or shards and their index), read safely.

Each file is opened with ``torch.load(weights_only=True)`` and nothing else: PyTorch's restricted
unpickler, which builds tensors and plain containers and refuses any other class, so a hostile
pickle cannot run code. The tensors are written once as safetensors into a temporary directory beside
the repo's config and tokenizer files, which the HF loader then reads as any other checkpoint (its
readers open only safetensors); the directory is removed when the load ends. ``model_config`` and
``plan_memory`` read only the tensors' names and dtypes (``header_dtypes``: the file memory-mapped, no
tensor copied).
"""

from __future__ import annotations

import pickle
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import save_file

from workbench.errors import CheckpointError
from workbench.hub.files import PICKLE_INDEX


@contextmanager
def as_safetensors(snapshot: Path, weights: Sequence[str], companions: Sequence[str]) -> Iterator[Path]:
    """A temporary directory holding ``companions`` (config, tokenizer files) copied from ``snapshot`` and every
    tensor of the pickled ``weights`` as one ``model.safetensors``.

    Example:
        >>> with as_safetensors(Path("snapshot"), ["pytorch_model.bin"], ["config.json"]) as d:   # doctest: +SKIP
        ...     sorted(p.name for p in d.iterdir())
        ['config.json', 'model.safetensors']
    """
    with tempfile.TemporaryDirectory(prefix="workbench-unpickled-") as temporary:
        directory = Path(temporary)
        for name in companions:
            shutil.copyfile(snapshot / name, directory / name)
        tensors: dict[str, torch.Tensor] = {}
        for name in weights:
            if name != PICKLE_INDEX:
                tensors.update(read_pickled_weights(snapshot / name))
        save_file(_unshared(tensors), str(directory / "model.safetensors"))
        yield directory


def read_pickled_weights(path: Path) -> dict[str, torch.Tensor]:
    """The name -> tensor dict a ``pytorch_model.bin`` holds, unpickled with ``torch.load(weights_only=True)``.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "pytorch_model.bin"
        >>> torch.save({"w": torch.ones(2)}, path)
        >>> read_pickled_weights(path)
        {'w': tensor([1., 1.])}
    """
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as error:
        raise CheckpointError(f"{path}: not a weights-only PyTorch checkpoint (torch.load(weights_only=True) "
                              f"refused it: {str(error).splitlines()[0]})") from error
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise CheckpointError(f"{path}: expected a dict of tensor name -> tensor, got {type(state).__name__}")
    return state


def header_dtypes(snapshot: Path, weights: Sequence[str]) -> dict[str, str]:
    """Tensor name -> safetensors dtype name ("F32", "BF16" ...) over the pickled ``weights``, as a safetensors
    header would say: each file memory-mapped by ``torch.load(weights_only=True, mmap=True)``, no tensor read.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> torch.save({"w": torch.ones(2, dtype=torch.bfloat16), "n": torch.zeros(1)}, folder / "pytorch_model.bin")
        >>> header_dtypes(folder, ["pytorch_model.bin"])
        {'w': 'BF16', 'n': 'F32'}
    """
    from workbench.cache_store import SAFETENSORS_DTYPES

    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    dtypes = {}
    for name in weights:
        if name == PICKLE_INDEX:
            continue
        for tensor_name, tensor in read_pickled_weights(snapshot / name).items():
            if tensor.dtype not in names:
                raise CheckpointError(f"{snapshot / name}: tensor {tensor_name!r} has dtype {tensor.dtype}, which no "
                                      f"checkpoint we read holds ({', '.join(map(str, names))})")
            dtypes[tensor_name] = names[tensor.dtype]
    return dtypes


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor contiguous and on a storage of its own (safetensors refuses tied views of one storage)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen or not tensor.is_contiguous() else tensor
        seen.add(pointer)
    return out
