"""Llama Scope (SAELens's ``llama_scope`` kind) and Llama Scope R1 Distill (``llama_scope_r1_distill``), converted
as SAELens 6.54.12 does.

Both are OpenMOSS's JumpReLU SAEs in PyTorch's ``nn.Linear`` layout (``encoder.weight [d_sae, d_in]``,
``decoder.weight [d_in, d_sae]``: transposed to SAELens's), trained on activations scaled to norm ``sqrt(d_in)``
(``normalize_activations: expected_average_only_in``; the registry's ``norm_scaling_factor`` is folded in by the
loader). Llama Scope keeps ``hyperparams.json`` and ``checkpoints/final.safetensors`` and one threshold for every
feature, stated for scaled inputs: SAELens multiplies it by ``sqrt(d_in) / dataset_average_activation_norm.in`` so
that it still holds once the scaling is folded into ``W_enc``. R1 Distill keeps ``config.json`` and
``sae_weights.safetensors`` with a per-feature ``log_jumprelu_threshold``.

SAELens's own configs say ``bfloat16`` for Llama Scope, but its ``SAE.from_pretrained`` always overrides the dtype
(float32 unless asked): float32 here too, so the defaults load the same numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from workbench.errors import CheckpointError, ConfigError
from workbench.sae.foreign.kinds import ForeignKind, read_config, read_safetensors

LLAMA_MODEL = "meta-llama/Llama-3.1-8B"
# What both trainings held, as SAELens states it.
_FIXED = {"architecture": "jumprelu", "dtype": "float32", "model_name": LLAMA_MODEL, "hook_head_index": None,
          "activation_fn": "relu", "finetuning_scaling_factor": False, "sae_lens_training_version": None,
          "prepend_bos": True, "dataset_path": "cerebras/SlimPajama-627B", "context_size": 1024,
          "dataset_trust_remote_code": True, "apply_b_dec_to_input": False,
          "normalize_activations": "expected_average_only_in"}


def llama_scope_config(hyperparams: Mapping[str, Any], source: str = "hyperparams.json") -> dict[str, Any]:
    """SAELens's config of a Llama Scope SAE from its ``hyperparams.json``, with ``jump_relu_threshold`` rescaled
    for the folded norm scaling (times ``sqrt(d_model) / dataset_average_activation_norm.in``).

    Example:
        >>> cfg = llama_scope_config({"d_model": 16, "d_sae": 32, "jump_relu_threshold": 0.5,
        ...                           "dataset_average_activation_norm": {"in": 2.0},
        ...                           "hook_point_in": "blocks.3.hook_resid_post"})
        >>> cfg["d_in"], cfg["d_sae"], cfg["jump_relu_threshold"], cfg["hook_name"], cfg["normalize_activations"]
        (16, 32, 1.0, 'blocks.3.hook_resid_post', 'expected_average_only_in')
    """
    d_in = _number(hyperparams, "d_model", source, int)
    norms = hyperparams.get("dataset_average_activation_norm")
    if not isinstance(norms, Mapping):
        raise ConfigError(f"{source}: field 'dataset_average_activation_norm' must be an object with 'in', got "
                          f"{norms!r}")
    norm_in = _number(norms, "in", source, float)
    if norm_in <= 0:
        raise ConfigError(f"{source}: field 'dataset_average_activation_norm.in' must be positive, got {norm_in!r}")
    norm_scaling_factor = d_in ** 0.5 / norm_in
    return {**_FIXED, "jump_relu_threshold": _number(hyperparams, "jump_relu_threshold", source, float)
            * norm_scaling_factor, "d_in": d_in, "d_sae": _number(hyperparams, "d_sae", source, int),
            "hook_name": _hook(hyperparams, source)}


def llama_scope_r1_distill_config(config: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """SAELens's config of a Llama Scope R1 Distill SAE from its ``config.json`` (``d_sae`` is ``d_model`` times
    ``expansion_factor``).

    Example:
        >>> cfg = llama_scope_r1_distill_config({"d_model": 16, "expansion_factor": 2,
        ...                                      "hook_point_in": "blocks.0.hook_resid_post"})
        >>> cfg["d_in"], cfg["d_sae"], cfg["model_name"], cfg["dtype"]
        (16, 32, 'meta-llama/Llama-3.1-8B', 'float32')
    """
    d_in = _number(config, "d_model", source, int)
    return {**_FIXED, "d_in": d_in, "d_sae": d_in * _number(config, "expansion_factor", source, int),
            "hook_name": _hook(config, source)}


def linear_layout_tensors(loaded: Mapping[str, Tensor], source: str) -> dict[str, Tensor]:
    """SAELens's ``W_enc``, ``W_dec``, ``b_enc``, ``b_dec`` from ``nn.Linear``-named tensors (weights transposed).

    Example:
        >>> out = linear_layout_tensors({"encoder.weight": torch.ones(3, 2), "decoder.weight": torch.ones(2, 3),
        ...                              "encoder.bias": torch.zeros(3), "decoder.bias": torch.zeros(2)},
        ...                             "final.safetensors")
        >>> {name: tuple(tensor.shape) for name, tensor in out.items()}
        {'W_enc': (2, 3), 'W_dec': (3, 2), 'b_enc': (3,), 'b_dec': (2,)}
    """
    names = ("encoder.weight", "decoder.weight", "encoder.bias", "decoder.bias")
    missing = [name for name in names if name not in loaded]
    if missing:
        raise CheckpointError(f"{source}: missing {', '.join(map(repr, missing))} (the SAE stores {', '.join(names)})")
    for name in ("encoder.weight", "decoder.weight"):
        if loaded[name].ndim != 2:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(loaded[name].shape)}, expected two axes")
    return {"W_enc": loaded["encoder.weight"].T, "W_dec": loaded["decoder.weight"].T,
            "b_enc": loaded["encoder.bias"], "b_dec": loaded["decoder.bias"]}


# Each kind's files in its folder: (config, weights).
_LLAMA_SCOPE_FILES = ("hyperparams.json", "checkpoints/final.safetensors")
_R1_DISTILL_FILES = ("config.json", "sae_weights.safetensors")


def _read(paths: Mapping[str, Path], row: Mapping[str, Any], entry: Mapping[str, Any], names: tuple[str, str],
          config_of) -> tuple[dict[str, Any], dict[str, Tensor], Path]:
    """The kind's config (the release's overrides laid over it), its tensors in float32 and the weights' path."""
    config_path, weights = (paths[f"{entry['path']}/{name}"] for name in names)
    cfg = {**config_of(read_config(config_path), str(config_path)), **(row.get("config_overrides") or {})}
    return cfg, _float32(read_safetensors(weights)), weights


def _llama_scope_convert(paths: Mapping[str, Path], row: Mapping[str, Any],
                         entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    cfg, loaded, weights = _read(paths, row, entry, _LLAMA_SCOPE_FILES, llama_scope_config)
    tensors = linear_layout_tensors(loaded, str(weights))
    # One threshold for every feature (SAELens's torch.ones(d_sae) * threshold, in float32).
    tensors["threshold"] = torch.ones(cfg["d_sae"], dtype=torch.float32) * cfg["jump_relu_threshold"]
    return cfg, tensors


def _r1_distill_convert(paths: Mapping[str, Path], row: Mapping[str, Any],
                        entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    cfg, loaded, weights = _read(paths, row, entry, _R1_DISTILL_FILES, llama_scope_r1_distill_config)
    if "log_jumprelu_threshold" not in loaded:
        raise CheckpointError(f"{weights}: missing 'log_jumprelu_threshold' (Llama Scope R1 Distill stores the "
                              "log of each feature's threshold)")
    return cfg, {**linear_layout_tensors(loaded, str(weights)), "threshold": loaded["log_jumprelu_threshold"].exp()}


def _files_of(names: tuple[str, str]):
    return lambda folder, row, entry: [f"{folder}/{name}" for name in names]


def _float32(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """SAELens reads these weights in the config's dtype (float32 under ``from_pretrained``) before converting."""
    return {name: tensor.to(torch.float32) for name, tensor in tensors.items()}


def _number(config: Mapping[str, Any], name: str, source: str, kind: type) -> Any:
    value = config.get(name)
    good = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not good:
        raise ConfigError(f"{source}: field {name!r} must be {'an integer' if kind is int else 'a number'}, "
                          f"got {value!r}")
    return value


def _hook(config: Mapping[str, Any], source: str) -> str:
    hook = config.get("hook_point_in")
    if not isinstance(hook, str):
        raise ConfigError(f"{source}: field 'hook_point_in' must be a hook point name, got {hook!r}")
    return hook


LLAMA_SCOPE = ForeignKind("llama_scope", _files_of(_LLAMA_SCOPE_FILES), _llama_scope_convert)
LLAMA_SCOPE_R1_DISTILL = ForeignKind("llama_scope_r1_distill", _files_of(_R1_DISTILL_FILES), _r1_distill_convert)
