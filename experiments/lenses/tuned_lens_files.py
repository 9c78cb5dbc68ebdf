"""tuned-lens 0.2's files: ``config.json`` (``TunedLensConfig``) and ``params.pt`` (the ``layer_translators`` state
dict: "0.weight" [D, D], "0.bias" [D], ... one pair per layer), as its ``TunedLens.save`` writes and
``from_model_and_pretrained`` reads them. The pickle is only ever read through ``torch.load(weights_only=True)``
(tensors and plain containers, no code); a ``params.safetensors`` beside the config is read as well.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

import torch
from torch import Tensor

from experiments.lenses.config import TunedLensConfig
from workbench.errors import CheckpointError
from workbench.safe_files import inside, read_json, save_files
from workbench.shipped import shipped_folder

CONFIG_FILE = "config.json"
PARAMS_FILE = "params.pt"
SAFETENSORS_FILE = "params.safetensors"
MAX_CONFIG_BYTES = 1 << 16


def read_lens(path: Union[str, Path]):
    """(``TunedLensConfig``, state dict) from tuned-lens's files in folder ``path``, or from the lens shipped under
    that name when no such folder exists (``wb.shipped(kind="lens")``), then in float32 as ``wb.load_sae`` opens a
    shipped SAE (its float16 files keep the repository small; float16 is slow on a CPU).

    Example:
        >>> import tempfile
        >>> from experiments.lenses import TunedLens
        >>> config, state = read_lens(TunedLens.for_model(model).save(tempfile.mkdtemp()))
        >>> config.d_model, sorted(state)[:2]
        (128, ['0.bias', '0.weight'])
        >>> read_lens("smollm2-135m-tuned-lens")[0].num_hidden_layers
        30
    """
    folder, by_name = Path(path), False
    if not folder.is_dir() and (shipped := shipped_folder(path, "lens")) is not None:
        folder, by_name = shipped, True
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder holding a tuned lens ({CONFIG_FILE} and {PARAMS_FILE}), nor the "
                              "name of a shipped one (wb.shipped(kind='lens'))")
    config = TunedLensConfig.from_dict(read_json(inside(folder, CONFIG_FILE, must_exist=True), MAX_CONFIG_BYTES,
                                                 "tuned lens config.json"))
    params = folder / PARAMS_FILE
    if params.is_file():
        try:
            state = torch.load(params, map_location="cpu", weights_only=True)
        except Exception as error:  # a truncated or foreign pickle: say which file
            raise CheckpointError(f"{params}: not a tuned-lens params file readable with weights_only=True "
                                  f"({type(error).__name__}: {error})") from None
    elif (folder / SAFETENSORS_FILE).is_file():
        from safetensors.torch import load_file

        state = load_file(str(folder / SAFETENSORS_FILE))
    else:
        raise CheckpointError(f"{folder}: has no {PARAMS_FILE} (or {SAFETENSORS_FILE})")
    if not isinstance(state, dict):
        raise CheckpointError(f"{params}: holds a {type(state).__name__}, not the translators' state dict")
    if by_name:
        state = {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    return config, state


def check_state(state: dict, config) -> None:
    """Refuses (``CheckpointError``) a state dict whose keys, shapes or dtypes are not ``config``'s translators.

    Example:
        >>> check_state({"0.weight": torch.zeros(3, 3)}, TunedLensConfig("m", 4, 1, bias=False))
        Traceback (most recent call last):
        workbench.errors.CheckpointError: tuned lens params: 0.weight has shape (3, 3), expected (4, 4)
    """
    D = config.d_model
    expected = {f"{l}.weight": (D, D) for l in range(config.num_hidden_layers)}
    if config.bias:
        expected.update({f"{l}.bias": (D,) for l in range(config.num_hidden_layers)})
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise CheckpointError(f"tuned lens params: missing {missing[:4]}, unexpected {extra[:4]} for "
                              f"{config.num_hidden_layers} layers (bias={config.bias})")
    for name, shape in expected.items():
        tensor = state[name]
        if not isinstance(tensor, Tensor) or not tensor.dtype.is_floating_point:
            raise CheckpointError(f"tuned lens params: {name} is not a floating-point tensor")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"tuned lens params: {name} has shape {tuple(tensor.shape)}, expected {shape}")
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"tuned lens params: {name} holds NaN or infinite values")


def write_lens(path: Union[str, Path], config, state: dict[str, Tensor]) -> Path:
    """Writes ``config.json`` and ``params.pt`` (tuned-lens 0.2's names and layout) into folder ``path``.

    Example:
        >>> import tempfile
        >>> folder = write_lens(tempfile.mkdtemp(), TunedLensConfig("m", 2, 1), {"0.weight": torch.eye(2),
        ...                                                                   "0.bias": torch.zeros(2)})
        >>> json.loads((folder / "config.json").read_text())["d_model"]
        2
    """
    state = {name: tensor.detach().cpu().contiguous().clone() for name, tensor in state.items()}
    return save_files(path, {
        PARAMS_FILE: lambda target: torch.save(state, target),
        CONFIG_FILE: lambda target: target.write_text(json.dumps(config.to_dict(), indent=2)),
    }, what="tuned lens")
