"""The tensors of an HF checkpoint directory: one ``*.safetensors`` file or shards with an index.

Nothing is unpickled: a directory holding only ``pytorch_model.bin`` (a pickle) is refused.
Tensors are read lazily with ``safetensors.safe_open`` (memory-mapped), each by name, and the
reader remembers which were taken, so a loader can report tensors it did not understand.
Every error names the file and the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor
from tqdm.auto import tqdm

from workbench.cache_store import is_plain_file_name
from workbench.errors import CheckpointError
from workbench.loading.common import show_progress

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_HEADER_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")


class SafetensorsCheckpoint:
    """Name -> tensor over all the safetensors files of one checkpoint directory.

    Example:
        >>> from workbench.loading.registry import ZOO
        >>> ckpt = SafetensorsCheckpoint(ZOO / "toy-attn-2l", progress=False)   # any directory of safetensors files
        >>> ckpt.take("embed.W_E", (2048, 128)).shape
        torch.Size([2048, 128])
        >>> len(ckpt.untaken()), "embed.W_E" in ckpt.untaken()
        (15, False)
    """

    def __init__(self, directory: Path, progress: Optional[bool] = None):
        self.directory = Path(directory)
        files, self.file_of = _checkpoint_files(self.directory)  # file_of: tensor name -> file path
        self._handles = {path: _open(path) for path in files}
        for path, handle in self._handles.items():
            for name in handle.keys():
                self.file_of.setdefault(name, path)
        for name, path in self.file_of.items():
            if name not in self._handles[path].keys():
                raise CheckpointError(f"{path}: tensor '{name}' is listed in {INDEX_FILE} but not in this file")
        self._taken: set[str] = set()
        total_bytes = sum(path.stat().st_size for path in self._handles)
        show = show_progress(total_bytes, progress)
        self._bar = tqdm(total=len(self.file_of), desc=f"loading {self.directory.name}", unit="tensor",
                         disable=not show, leave=False)

    @property
    def source(self) -> str:
        """The file(s) tensors come from, for messages."""
        files = sorted(str(p) for p in self._handles)
        return files[0] if len(files) == 1 else f"{self.directory} ({len(files)} shards)"

    def has(self, name: str) -> bool:
        return name in self.file_of

    def config_data(self) -> dict:
        """The directory's config.json as a dict (for the rare value a family reads beside ``ModelConfig``).

        Example:
            >>> from workbench.loading.registry import ZOO
            >>> SafetensorsCheckpoint(ZOO / "toy-attn-2l", progress=False).config_data()["n_layers"]
            2
        """
        path = self.directory / "config.json"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{path}: unreadable config ({error})") from error

    def take(self, name: str, shape: Optional[tuple[int, ...]] = None) -> Tensor:
        """The tensor called ``name`` (marked as used).

        A ``CheckpointError`` naming the file and the tensor if it is absent, unreadable, or not
        of ``shape`` (when given).
        """
        path = self.file_of.get(name)
        if path is None:
            raise CheckpointError(f"{self.source}: missing tensor '{name}'")
        try:
            tensor = self._handles[path].get_tensor(name)
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{path}: cannot read tensor '{name}' ({error})") from error
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"{path}: tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        self._taken.add(name)
        self._bar.update(1)
        return tensor

    def take_unembedding(self, name: str, shape: tuple[int, int], tied: bool) -> dict[str, Tensor]:
        """``{"unembed._W_U_lin": tensor}`` for an untied model; ``{}`` for a tied one, whose
        checkpoint may still hold the shared matrix a second time (then marked used, not loaded).

        Example:
            >>> from workbench.loading.registry import ZOO
            >>> ckpt = SafetensorsCheckpoint(ZOO / "toy-attn-2l", progress=False)
            >>> list(ckpt.take_unembedding("unembed._W_U_lin", (2048, 128), tied=False))
            ['unembed._W_U_lin']
            >>> ckpt.take_unembedding("unembed._W_U_lin", (2048, 128), tied=True)   # marked used, not loaded
            {}
        """
        if not tied:
            return {"unembed._W_U_lin": self.take(name, shape)}
        if self.has(name):
            self.take(name)
        return {}

    def stored_dtype(self) -> torch.dtype:
        """The dtype the weights are stored in (the first floating-point tensor's), read from the headers only.

        Example:
            >>> from workbench.loading.registry import ZOO
            >>> SafetensorsCheckpoint(ZOO / "toy-attn-2l", progress=False).stored_dtype()
            torch.float32
        """
        for name, path in self.file_of.items():
            dtype = _HEADER_DTYPES.get(self._handles[path].get_slice(name).get_dtype())
            if dtype is not None:
                return dtype
        return torch.float32

    def skip(self, name: str) -> None:
        """Marks a tensor the model deliberately leaves unread (DeepSeek-V3's multi-token-prediction
        layers), so it is not reported as unexpected.

        Example:
            >>> from workbench.loading.registry import ZOO
            >>> ckpt = SafetensorsCheckpoint(ZOO / "toy-attn-2l", progress=False)
            >>> ckpt.skip("blocks.1.ln1.b")
            >>> "blocks.1.ln1.b" in ckpt.untaken()
            False
        """
        self._taken.add(name)

    def untaken(self) -> list[str]:
        """Names present in the checkpoint that no loader step has read."""
        return sorted(set(self.file_of) - self._taken)

    def close(self) -> None:
        self._bar.close()
        self._handles.clear()


def tensor_names(directory: Path) -> list[str]:
    """Every tensor name a checkpoint directory holds, from its shard index and safetensors headers (no
    tensor data read).

    Example:
        >>> from workbench.loading.registry import ZOO
        >>> "embed.W_E" in tensor_names(ZOO / "toy-attn-2l")
        True
    """
    files, file_of = _checkpoint_files(Path(directory))
    names = set(file_of)
    for path in files:
        with _open(path) as handle:
            names.update(handle.keys())
    return sorted(names)


def _checkpoint_files(directory: Path) -> tuple[list[Path], dict[str, Path]]:
    """The weight files, and tensor -> file as the shard index states it ({} without an index)."""
    index_path = directory / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index_path}: unreadable shard index ({error!r})") from error
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: field 'weight_map' must map tensor names to shard file names")
        out = {}
        for name, file_name in weight_map.items():
            if not is_plain_file_name(file_name):  # checked before anything is opened: shards sit beside the index
                raise CheckpointError(f"{index_path}: weight_map['{name}'] = {file_name!r} is not a file name in "
                                      f"{directory} (a shard must sit beside the index)")
            path = directory / file_name
            if not path.exists():
                raise CheckpointError(f"{path}: shard file not found (it should hold tensor '{name}')")
            out[name] = path
        return sorted(set(out.values())), out
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = [name for name in PICKLE_FILES if (directory / name).exists()]
        if pickles:
            raise CheckpointError(
                f"{directory / pickles[0]}: only pickled weights found; we never unpickle checkpoints. "
                "Convert them to safetensors (e.g. save_pretrained(..., safe_serialization=True)).")
        raise CheckpointError(f"{directory / SINGLE_FILE}: weights file not found (no *.safetensors in {directory})")
    return files, {}  # without an index, each file's own keys say what it holds


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({error})") from error
