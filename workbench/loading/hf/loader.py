"""HF-format directories (config.json + *.safetensors [+ index] [+ tokenizer.json]) -> ``Decoder``.

The architecture named in ``config.json`` picks a family module that maps the config onto
``ModelConfig`` and the HF tensors onto our names; nothing architecture-specific happens
outside those modules. Loading is atomic: the config is mapped, every tensor read and checked
(names and shapes), and only then is a model built, filled and returned.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch

from workbench.config import ModelConfig
from workbench.errors import CheckpointError
from workbench.loading.build import build_model, runtime_options
from workbench.loading.common import check_layer_count
from workbench.loading.family import Family, register
from workbench.loading.hf import (codegen, dbrx, deepseek, diffllama, falcon, gemma, gpt2, llama, llama4, minicpm3,
                                  modern, moe_families, mpt, neox, openai_gpt, opt_bloom, phi, starcoder, xglm)
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint, tensor_names
from workbench.loading.hf.config import HFConfig
from workbench.loading.hf.tokenizer import tokenizer_from_hf_directory
from workbench.loading.placement import Placement

CONFIG_FILE = "config.json"
# Where config.json states the layer count, by family (for the message refusing a count the weights lack).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")

# The family modules, each exporting FAMILIES (workbench.loading.family.Family), in the order
# wb.supported_architectures() lists them.
FAMILY_MODULES = (gpt2, llama, neox, gemma, phi, opt_bloom, deepseek, falcon, starcoder, mpt, codegen, xglm, openai_gpt,
                  modern, moe_families, llama4, minicpm3, dbrx, diffllama)

# architectures[0] in config.json -> the family that knows its config fields and tensor names
# (every family checked against the contract here, at import).
ARCHITECTURES: dict[str, Family] = register(FAMILY_MODULES)

# Architectures a family module refuses by name ({architecture: why}, a module's optional REFUSED).
REFUSED_ARCHITECTURES: dict[str, str] = {arch: why for module in FAMILY_MODULES
                                         for arch, why in getattr(module, "REFUSED", {}).items()}

# model_type -> architecture, for configs that lack the "architectures" list.
MODEL_TYPES = {family.architectures[arch][0]: arch for arch, family in ARCHITECTURES.items()}


# Name fragments of architectures that are not decoder-only transformers, and what they are.
_NOT_DECODERS = {"Mamba": "a state-space model", "Rwkv": "a recurrent model",
                 "ForConditionalGeneration": "an encoder-decoder or multimodal model",
                 "ForSeq2SeqLM": "an encoder-decoder model", "ForMaskedLM": "an encoder (masked LM)",
                 "Vision": "a vision model", "ForImageClassification": "a vision model"}


def is_hf_config(data: dict) -> bool:
    """config.json's data names a transformers architecture (``architectures`` or ``model_type``).

    Example:
        >>> is_hf_config({"model_type": "llama"}), is_hf_config({"format": "workbench"})
        (True, False)
    """
    return "architectures" in data or "model_type" in data


def read_config(path: Path) -> dict:
    """config.json as a dict, or a ``CheckpointError`` naming the file.

    Example:
        >>> from workbench.loading.registry import ZOO
        >>> read_config(ZOO / "toy-attn-2l" / "config.json")["n_layers"]
        2
        >>> read_config(ZOO / "no-such-model" / "config.json")
        Traceback (most recent call last):
        ...
        workbench.errors.CheckpointError: .../no-such-model/config.json: unreadable config ([Errno 2] No such file or directory: ...)
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable config ({error})") from error
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def architecture_of(data: dict, source: str) -> str:
    """The supported architecture config.json names, or a ``CheckpointError`` naming what it says.

    Example:
        >>> architecture_of({"architectures": ["Qwen2ForCausalLM"]}, "config.json")
        'Qwen2ForCausalLM'
    """
    names = data.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name
    if not names and data.get("model_type") in MODEL_TYPES:  # configs written without "architectures"
        return MODEL_TYPES[data["model_type"]]
    refused = next((name for name in names if name in REFUSED_ARCHITECTURES), None)
    if refused is not None:
        raise CheckpointError(f"{source}: architecture {refused!r} is not supported: {REFUSED_ARCHITECTURES[refused]}")
    stated = names or data.get("model_type")
    kind = next((why for marker, why in _NOT_DECODERS.items() if marker.lower() in str(stated).lower()), "")
    raise CheckpointError(
        f"{source}: unknown architecture {stated!r} (field '{'architectures' if names else 'model_type'}')"
        f"{f': {kind}, and only decoder-only transformers load' if kind else ''}; "
        f"supported: {sorted(ARCHITECTURES)} (see wb.supported_architectures())")


def checkpoint_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype a checkpoint's weights are stored in: that of its first floating-point tensor.

    Example:
        >>> checkpoint_dtype({"w": torch.zeros(2, dtype=torch.bfloat16)})
        torch.bfloat16
    """
    return next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)


def hf_model_config(directory: Union[str, Path]) -> ModelConfig:
    """The ``ModelConfig`` an HF directory's config.json describes (no weights read; dtype float32).

    Example:
        >>> hf_model_config("checkpoints/tiny-llama").n_layers   # doctest: +SKIP
        2
    """
    return _read_hf_config(Path(directory))[2]


def _read_hf_config(directory: Path) -> tuple[dict, str, ModelConfig]:
    """config.json's data, the architecture it names and the ``ModelConfig`` it maps to (read once)."""
    config_path = directory / CONFIG_FILE
    data = read_config(config_path)
    architecture = architecture_of(data, str(config_path))
    cfg = ARCHITECTURES[architecture].model_config(HFConfig(data, str(config_path)), architecture)
    field = next((key for key in LAYER_COUNT_KEYS if key in data), "num_hidden_layers")
    check_layer_count(cfg.n_layers, tensor_names(directory), str(config_path), field)
    return data, architecture, cfg.replace(model_name=directory.name)


def hf_checkpoint_dtype(directory: Union[str, Path]) -> torch.dtype:
    """The dtype an HF checkpoint's weights are stored in, from its safetensors header (no data read).

    Example:
        >>> from workbench.loading.registry import ZOO
        >>> hf_checkpoint_dtype(ZOO / "toy-attn-2l")   # any directory of safetensors files
        torch.float32
    """
    ckpt = SafetensorsCheckpoint(Path(directory), progress=False)
    try:
        return ckpt.stored_dtype()
    finally:
        ckpt.close()


def load_hf_directory(directory: Union[str, Path], attn_impl: str = "sdpa", dtype: Optional[torch.dtype] = None,
                      device: str = "cpu", progress: Optional[bool] = None, placement: Optional[Placement] = None):
    """Builds a ``Decoder`` from an HF-format checkpoint directory.

    Args:
        directory: holds config.json, model.safetensors (or shards + model.safetensors.index.json)
            and optionally tokenizer.json / tokenizer_config.json.
        attn_impl, device: as ``workbench.load_model``.
        dtype: the weights' dtype; None: the checkpoint's own (the first floating-point tensor's),
            so a bf16 checkpoint is read straight into bf16 with no float32 copy on the way.
        progress: show a progress bar over tensors (None: only for checkpoints over 64 MiB).
        placement: a device map across devices (``workbench.loading.placement``) instead of ``device``.

    Example:
        >>> model = load_hf_directory("checkpoints/tiny-llama", attn_impl="eager")   # doctest: +SKIP
    """
    directory = Path(directory)
    data, architecture, cfg = _read_hf_config(directory)
    family = ARCHITECTURES[architecture]
    runtime_options(cfg, dtype=dtype, attn_impl=attn_impl)  # a bad option fails before any tensor is read

    ckpt = SafetensorsCheckpoint(directory, progress=progress)
    try:
        tensors = family.convert_tensors(ckpt, cfg, architecture)
        leftover = [n for n in ckpt.untaken() if not family.ignored_tensors.fullmatch(n)]
        if leftover:
            raise CheckpointError(f"{ckpt.source}: unexpected tensor(s) {leftover[:5]}"
                                  f"{' ...' if len(leftover) > 5 else ''} for {architecture} with this config")
    finally:
        ckpt.close()
    tokenizer = tokenizer_from_hf_directory(directory, data)
    return build_model(cfg, tokenizer, tensors, ckpt.source, dtype=dtype or checkpoint_dtype(tensors),
                       attn_impl=attn_impl, device=device, placement=placement)
