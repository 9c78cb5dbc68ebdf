"""A steering vector on disk: ``vector.safetensors`` (one ``[D]`` tensor per layer, named ``layer.{l}``) and
``vector.json`` (format, layer type, layers, d_model, how it was made), written together through
``workbench.safe_files.save_files``. Reading checks the JSON and the safetensors header (names, shapes, dtypes)
before any tensor is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from workbench.errors import CheckpointError
from workbench.safe_files import inside, read_json, save_files

FORMAT = "workbench-steering-vector"
VERSION = 1
TENSORS, META = "vector.safetensors", "vector.json"
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
MAX_JSON_BYTES = 1 << 20


def save_vector(directions: dict[int, Tensor], folder: Union[str, Path], layer_type: str = "decoder_block",
                meta: Optional[dict] = None) -> Path:
    """Writes a vector's ``directions`` (layer -> ``[D]``, checked by ``SteeringVector``) into ``folder``; a failed
    save leaves the previous files.

    Example:
        >>> import tempfile
        >>> folder = save_vector({0: torch.ones(3)}, tempfile.mkdtemp())
        >>> sorted(p.name for p in folder.iterdir())
        ['vector.json', 'vector.safetensors']
    """
    tensors = {f"layer.{layer}": direction.detach().to("cpu").contiguous()
               for layer, direction in sorted(directions.items())}
    d_model = next(iter(directions.values())).shape[0]
    meta = {"format": FORMAT, "version": VERSION, "layer_type": layer_type,
            "layers": sorted(directions), "d_model": d_model, "meta": meta or {}}
    text = json.dumps(meta, indent=2, default=str)
    return save_files(folder, {TENSORS: lambda path: save_file(tensors, str(path)),
                               META: lambda path: path.write_text(text)}, what="steering vector folder")


def load_vector(folder: Union[str, Path]) -> tuple[dict[int, Tensor], str, dict]:
    """The vector in ``folder`` as (directions, layer type, meta); a JSON or header that does not describe
    ``[d_model]`` float tensors, one per listed layer, is refused (``CheckpointError``) before any tensor is read.

    Example:
        >>> import tempfile
        >>> folder = save_vector({2: torch.arange(3.0)}, tempfile.mkdtemp(), meta={"method": "caa"})
        >>> load_vector(folder)
        ({2: tensor([0., 1., 2.])}, 'decoder_block', {'method': 'caa'})
    """
    folder = Path(folder)
    meta_path = inside(folder, META, what="steering vector folder")
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path}: not found")
    meta = read_json(meta_path, MAX_JSON_BYTES, "a steering vector's vector.json")
    layers, d_model, layer_type = _checked_meta(meta, meta_path)
    tensor_path = inside(folder, TENSORS, must_exist=True, what="steering vector folder")
    try:
        with safe_open(str(tensor_path), framework="pt") as file:
            declared = {name: (tuple(file.get_slice(name).get_shape()), file.get_slice(name).get_dtype())
                        for name in file.keys()}
            expected = {f"layer.{layer}" for layer in layers}
            if set(declared) != expected:
                raise CheckpointError(f"{tensor_path}: holds tensors {sorted(declared)}, vector.json lists "
                                      f"{sorted(expected)}")
            for name, (shape, dtype) in declared.items():
                if dtype not in FLOAT_DTYPES:
                    raise CheckpointError(f"{tensor_path}: tensor {name!r} has dtype {dtype}; a steering vector is "
                                          f"floating-point ({', '.join(FLOAT_DTYPES)})")
                if shape != (d_model,):
                    raise CheckpointError(f"{tensor_path}: tensor {name!r} has shape {shape}, expected "
                                          f"[d_model] = ({d_model},)")
            directions = {layer: file.get_tensor(f"layer.{layer}") for layer in layers}
    except SafetensorError as error:
        raise CheckpointError(f"{tensor_path}: not a readable safetensors file ({error})") from None
    for layer, direction in directions.items():
        if not bool(torch.isfinite(direction).all()):
            raise CheckpointError(f"{tensor_path}: layer {layer}'s direction holds NaN or infinity")
    return directions, layer_type, dict(meta.get("meta") or {})


def _checked_meta(meta: object, path: Path) -> tuple[list[int], int, str]:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a steering vector's vector.json (format must be {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: version {meta.get('version')!r} is not supported (expected {VERSION})")
    layers, d_model = meta.get("layers"), meta.get("d_model")
    if (not isinstance(layers, list) or not layers
            or not all(isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0 for layer in layers)):
        raise CheckpointError(f"{path}: 'layers' must be a non-empty list of block indices, got {layers!r}")
    if not isinstance(d_model, int) or isinstance(d_model, bool) or d_model < 1:
        raise CheckpointError(f"{path}: 'd_model' must be a positive int, got {d_model!r}")
    layer_type = meta.get("layer_type", "decoder_block")
    if not isinstance(layer_type, str):
        raise CheckpointError(f"{path}: 'layer_type' must be a string, got {layer_type!r}")
    return layers, d_model, layer_type
