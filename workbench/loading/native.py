"""Our own format: config.json + model.safetensors (+ tokenizer.json, special_tokens.json).

Nothing is unpickled: weights are safetensors, the config is JSON validated by ``ModelConfig``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from workbench.config import ModelConfig
from workbench.errors import CheckpointError, ConfigError
from workbench.loading.weights import assign_weights
from workbench.tokenizer import Tokenizer

if TYPE_CHECKING:
    from workbench.model import Decoder

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_TAG = "workbench"


def save_native(model: "Decoder", directory: Union[str, Path]) -> Path:
    """Writes the model so ``load_native`` (and ``wb.load_model``) rebuild it exactly."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"format": FORMAT_TAG, **model.cfg.to_dict()}
    config.pop("device")
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    state = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied: the second name of one Parameter
            continue
        seen.add(id(tensor))
        state[name] = tensor.detach().cpu().contiguous()
    save_file(state, str(directory / WEIGHTS_FILE))
    if model.tokenizer is not None:
        model.tokenizer.save(directory)
    return directory


def is_native_directory(path: Path) -> bool:
    config = path / CONFIG_FILE
    return path.is_dir() and config.exists() and json.loads(config.read_text()).get("format") == FORMAT_TAG


def load_native(directory: Union[str, Path], attn_impl: str | None = None, dtype: torch.dtype | None = None,
                device: str = "cpu") -> "Decoder":
    """Rebuilds a model written by ``Decoder.save``."""
    from workbench.model import Decoder

    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{config_path}: cannot read the config ({error})") from error
    config.pop("format", None)
    try:
        cfg = ModelConfig.from_dict(config)
    except (ConfigError, TypeError) as error:
        raise CheckpointError(f"{config_path}: {error}") from error
    overrides = {k: v for k, v in (("attn_impl", attn_impl), ("dtype", dtype)) if v is not None}
    cfg = cfg.replace(**overrides)
    if not weights_path.exists():
        raise CheckpointError(f"{weights_path}: weights file not found")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{weights_path}: unreadable or truncated safetensors file ({error})") from error
    tokenizer = Tokenizer.from_directory(directory) if (directory / "tokenizer.json").exists() else None
    model = Decoder(cfg, tokenizer=tokenizer, init_weights=False)
    assign_weights(model, tensors, str(weights_path))
    return model.to(device)
