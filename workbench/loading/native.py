"""Reading our own format: config.json + model.safetensors (+ tokenizer.json, special_tokens.json).

Nothing is unpickled: weights are safetensors, the config is JSON validated by ``ModelConfig``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from workbench.config import ModelConfig
from workbench.errors import CheckpointError, ConfigError
from workbench.loading.build import build_model, runtime_options
from workbench.loading.common import check_layer_count
from workbench.loading.hf.checkpoint import tensor_names
from workbench.loading.placement import Placement
from workbench.model import Decoder
from workbench.options import RuntimeOptions, split_saved_config
from workbench.saving import CONFIG_FILE, FORMAT_TAG, WEIGHTS_FILE
from workbench.tokenizer import Tokenizer

__all__ = ["load_native", "FORMAT_TAG"]

# Files saved before the weights took TransformerLens's names (as views of private nn.Linear-layout
# storage) hold that same storage under the public names: renamed on reading, nothing reshaped.
_LEGACY_NAMES = re.compile(r"(?P<module>attn|mlp|unembed)\.(?P<name>W_[QKVO]|b_[QKV]|W_in|W_gate|W_out|W_router|W_U)$")


def _current_names(tensors: dict) -> dict:
    """Tensor names of a file in today's layout (legacy public names -> their private storage names)."""
    return {_LEGACY_NAMES.sub(r"\g<module>._\g<name>_lin", name): tensor for name, tensor in tensors.items()}


def native_config(directory: Union[str, Path]) -> ModelConfig:
    """The ``ModelConfig`` a directory written by ``Decoder.save`` holds (no weights read).

    Example:
        >>> from workbench.loading.registry import ZOO
        >>> native_config(ZOO / "toy-attn-2l").n_layers
        2
    """
    return read_native_config(directory)[0]


def read_native_config(directory: Union[str, Path]) -> tuple[ModelConfig, dict]:
    """A saved model's config.json as (the architecture, the runtime options it was saved with).

    Example:
        >>> from workbench.loading.registry import ZOO
        >>> cfg, options = read_native_config(ZOO / "toy-attn-2l")
        >>> cfg.n_layers, options["dtype"]
        (2, 'float32')
    """
    config_path = Path(directory) / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{config_path}: cannot read the config ({error})") from error
    config = {key: value for key, value in config.items() if key != "format"}
    try:
        cfg, options = split_saved_config(config)
        RuntimeOptions(**options)  # each saved option checked here, so a bad one names this file
    except (ConfigError, TypeError) as error:  # a config the model cannot honour names the file
        raise CheckpointError(f"{config_path}: {error}") from error
    weights_path = Path(directory) / WEIGHTS_FILE
    if weights_path.exists():  # its header only: a declared layer count the weights lack is refused here
        check_layer_count(cfg.n_layers, tensor_names(Path(directory)), str(config_path), "n_layers")
    return cfg, options


def load_native(directory: Union[str, Path], attn_impl: str | None = None, dtype: torch.dtype | None = None,
                device: str = "cpu", placement: Optional[Placement] = None) -> Decoder:
    """Rebuilds a model written by ``Decoder.save`` (``workbench.saving``).

    Example:
        >>> from workbench.loading.registry import ZOO
        >>> load_native(ZOO / "toy-attn-2l", attn_impl="eager").cfg.attn_impl
        'eager'
    """
    directory = Path(directory)
    weights_path = directory / WEIGHTS_FILE
    cfg, saved = read_native_config(directory)
    runtime_options(cfg, dtype=dtype, attn_impl=attn_impl, saved=saved)  # a bad option fails before the weights are read
    if not weights_path.exists():
        raise CheckpointError(f"{weights_path}: weights file not found")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{weights_path}: unreadable or truncated safetensors file ({error})") from error
    tokenizer = Tokenizer.from_directory(directory) if (directory / "tokenizer.json").exists() else None
    return build_model(cfg, tokenizer, _current_names(tensors), str(weights_path), dtype=dtype, attn_impl=attn_impl,
                       device=device, placement=placement, saved_options=saved)
