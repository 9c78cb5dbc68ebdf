"""llama.cpp control vectors, the GGUF repeng 0.4 writes (``ControlVector.export_gguf``): architecture
``controlvector``, ``controlvector.model_hint`` (the model type, e.g. "llama"), ``controlvector.layer_count`` and
one float32 tensor ``direction.{layer}`` per layer, ``layer`` being the block whose output it is added to (repeng's
numbering, the same as ``SteeringVector.layer_activations``').
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import gguf
import numpy as np
import torch

from torch import Tensor

from workbench.errors import CheckpointError, InputError

ARCH = "controlvector"


def write_control_vector(directions: dict[int, Tensor], path: Union[str, Path], model_hint: str = "llama") -> Path:
    """Writes a vector's ``directions`` (layer -> ``[D]``) as a control vector GGUF at ``path`` (its folder must exist).

    Example:
        >>> import tempfile, os
        >>> path = write_control_vector({0: torch.ones(4)}, os.path.join(tempfile.mkdtemp(), "c.gguf"))
        >>> path.stat().st_size > 0
        True
    """
    path = Path(path)
    if not isinstance(model_hint, str) or not model_hint:
        raise InputError(f"model_hint must be a non-empty string, got {model_hint!r}")
    if not path.parent.is_dir():
        raise InputError(f"{path.parent}: no such folder to write the control vector into")
    temporary = path.with_name(path.name + ".partial")   # renamed into place only when complete
    try:
        writer = gguf.GGUFWriter(str(temporary), ARCH)
        writer.add_string(f"{ARCH}.model_hint", model_hint)
        writer.add_uint32(f"{ARCH}.layer_count", len(directions))
        for layer, direction in sorted(directions.items()):
            writer.add_tensor(f"direction.{layer}", direction.detach().to("cpu", torch.float32).numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def read_control_vector(path: Union[str, Path]) -> tuple[dict[int, Tensor], object]:
    """The control vector GGUF at ``path`` as (directions, model hint): every ``direction.{layer}`` tensor, each
    checked to be a 1-D float of one common size.

    Example:
        >>> import tempfile, os
        >>> path = write_control_vector({3: torch.arange(4.0)}, os.path.join(tempfile.mkdtemp(), "c.gguf"))
        >>> directions, hint = read_control_vector(path)
        >>> directions[3].tolist(), hint
        ([0.0, 1.0, 2.0, 3.0], 'llama')
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: not found")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError) as error:
        raise CheckpointError(f"{path}: not a readable GGUF file ({error})") from None
    arch = _string_field(reader, "general.architecture")
    if arch != ARCH:
        raise CheckpointError(f"{path}: architecture {arch!r} is not a control vector ({ARCH!r})")
    directions = {}
    for tensor in reader.tensors:
        if not tensor.name.startswith("direction."):
            continue
        suffix = tensor.name.split(".", 1)[1]
        if not suffix.isdigit():
            raise CheckpointError(f"{path}: tensor {tensor.name!r} is not named direction.<layer>")
        data = np.asarray(tensor.data)
        if data.dtype.kind != "f" or data.ndim != 1:
            raise CheckpointError(f"{path}: tensor {tensor.name!r} must be a 1-D float vector, got "
                                  f"{data.dtype} of shape {data.shape}")
        directions[int(suffix)] = torch.from_numpy(data.astype(np.float32).copy())
    if not directions:
        raise CheckpointError(f"{path}: holds no direction.<layer> tensors")
    if len({d.shape[0] for d in directions.values()}) != 1:
        raise CheckpointError(f"{path}: the directions have different sizes "
                              f"{sorted({d.shape[0] for d in directions.values()})}")
    return dict(sorted(directions.items())), _string_field(reader, f"{ARCH}.model_hint")


def _string_field(reader: "gguf.GGUFReader", key: str):
    field = reader.get_field(key)
    if field is None or not len(field.parts):
        return None
    return bytes(field.parts[-1]).decode("utf-8", errors="replace")
