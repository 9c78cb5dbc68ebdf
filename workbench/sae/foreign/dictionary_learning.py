"""SAEs trained by ``dictionary_learning`` (SAELens's ``dictionary_learning_1`` kind: SAEBench's and andyrdt's
releases), converted as SAELens 6.54.12 does.

Each folder holds ``config.json`` (``trainer``: ``dict_class``, ``activation_dim``, ``dict_size``, ``layer``,
``lm_name``, ``k``; ``buffer.ctx_len``) and ``ae.pt``, a state dict read with ``torch.load(weights_only=True)`` only.
The class names the architecture: ``AutoEncoderTopK`` is top-k, ``GatedAutoEncoder`` gated, ``BatchTopKSAE`` and
``MatryoshkaBatchTopKSAE`` JumpReLU (their global threshold for every feature), ``JumpReluAutoEncoder`` JumpReLU
without ``b_dec`` subtracted from the input; anything else a standard ReLU SAE. The weights are stored either in
SAELens's layout (``W_enc``, ``W_dec``) or as ``nn.Linear`` (``encoder.weight``, transposed), with the decoder bias
under one of three names; what a class stores beside them (``k``, a top-k SAE's running threshold) is not read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from workbench.errors import CheckpointError, ConfigError
from workbench.sae.foreign.kinds import ForeignKind, read_config, read_torch

# dictionary_learning's class -> (SAELens's architecture, whether b_dec is subtracted from the input).
DICT_CLASSES = {"GatedAutoEncoder": ("gated", True), "MatryoshkaBatchTopKSAE": ("jumprelu", True),
                "BatchTopKSAE": ("jumprelu", True), "JumpReluAutoEncoder": ("jumprelu", False)}
# ae.pt's name -> SAELens's, for the tensors read where present (the first name found wins for b_dec).
_DECODER_BIASES = ("b_dec", "bias", "decoder_bias")
_RENAMED = {"encoder.bias": "b_enc", "b_enc": "b_enc", "mag_bias": "b_mag", "gate_bias": "b_gate", "r_mag": "r_mag"}


def dictionary_learning_config(config: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """SAELens's config (pre-6.0, flat) of a ``dictionary_learning`` SAE from its ``config.json``.

    Example:
        >>> cfg = dictionary_learning_config({"trainer": {"dict_class": "AutoEncoderTopK", "k": 4, "layer": 3,
        ...     "activation_dim": 16, "dict_size": 32, "lm_name": "EleutherAI/pythia-70m-deduped"},
        ...     "buffer": {"ctx_len": 128}})
        >>> cfg["architecture"], cfg["activation_fn_kwargs"], cfg["model_name"], cfg["hook_name"], cfg["context_size"]
        ('standard', {'k': 4}, 'pythia-70m-deduped', 'blocks.3.hook_resid_post', 128)
    """
    trainer, buffer = config.get("trainer"), config.get("buffer")
    if not isinstance(trainer, Mapping) or not isinstance(buffer, Mapping):
        raise ConfigError(f"{source}: a dictionary_learning config has 'trainer' and 'buffer' objects")
    for name in ("dict_class", "lm_name"):
        if not isinstance(trainer.get(name), str):
            raise ConfigError(f"{source}: field 'trainer.{name}' must be a string, got {trainer.get(name)!r}")
    for name in ("activation_dim", "dict_size", "layer"):
        value = trainer.get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: field 'trainer.{name}' must be an integer, got {value!r}")
    topk = trainer["dict_class"] == "AutoEncoderTopK"
    if topk and "k" not in trainer:
        raise ConfigError(f"{source}: an AutoEncoderTopK's config has no 'trainer.k'")
    architecture, apply_b_dec_to_input = DICT_CLASSES.get(trainer["dict_class"], ("standard", True))
    return {"architecture": architecture, "d_in": trainer["activation_dim"], "d_sae": trainer["dict_size"],
            "dtype": "float32", "model_name": trainer["lm_name"].split("/")[-1],
            "hook_name": f"blocks.{trainer['layer']}.hook_resid_post", "hook_head_index": None,
            "activation_fn": "topk" if topk else "relu", "activation_fn_kwargs": {"k": trainer["k"]} if topk else {},
            "apply_b_dec_to_input": apply_b_dec_to_input, "finetuning_scaling_factor": False,
            "sae_lens_training_version": None, "prepend_bos": True, "dataset_path": "monology/pile-uncopyrighted",
            "context_size": buffer.get("ctx_len"), "normalize_activations": "none", "neuronpedia_id": None,
            "dataset_trust_remote_code": True}


def dictionary_learning_tensors(state: Mapping[str, Any], architecture: str, source: str) -> dict[str, Tensor]:
    """SAELens's tensors from an ``ae.pt`` state dict: either layout, the decoder bias under any of its names, a
    JumpReLU's scalar threshold broadcast to every feature.

    Example:
        >>> state = {"encoder.weight": torch.ones(3, 2), "encoder.bias": torch.zeros(3),
        ...          "decoder.weight": torch.ones(2, 3), "b_dec": torch.zeros(2), "threshold": torch.tensor(0.5),
        ...          "k": torch.tensor(2)}
        >>> out = dictionary_learning_tensors(state, "jumprelu", "ae.pt")
        >>> sorted(out), tuple(out["W_enc"].shape), out["threshold"].tolist()
        (['W_dec', 'W_enc', 'b_dec', 'b_enc', 'threshold'], (2, 3), [0.5, 0.5, 0.5])
    """
    tensors: dict[str, Any] = {}
    for ours, linear in (("W_enc", "encoder.weight"), ("W_dec", "decoder.weight")):
        if ours in state:
            tensors[ours] = state[ours]
        elif linear in state:
            tensors[ours] = _matrix(state[linear], linear, source).T
        else:
            raise CheckpointError(f"{source}: neither {ours!r} nor {linear!r} (a dictionary_learning SAE stores one)")
    bias = next((name for name in _DECODER_BIASES if name in state), None)
    if bias is not None:
        tensors["b_dec"] = state[bias]
    for name, ours in _RENAMED.items():
        if name in state:
            tensors[ours] = state[name]
    if "threshold" in state and architecture == "jumprelu":  # a top-k SAE's threshold is not used to encode
        threshold = state["threshold"]
        if isinstance(threshold, Tensor) and threshold.ndim == 0 and isinstance(tensors["W_enc"], Tensor):
            threshold = torch.full((tensors["W_enc"].size(1),), threshold.item(), dtype=threshold.dtype)
        tensors["threshold"] = threshold
    return tensors


def _matrix(value: Any, name: str, source: str) -> Tensor:
    if not isinstance(value, Tensor) or value.ndim != 2:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise CheckpointError(f"{source}: {name!r} must be a two-axis tensor, got {shape}")
    return value


def _files(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    return [f"{folder}/config.json", f"{folder}/ae.pt"]


def _convert(paths: Mapping[str, Path], row: Mapping[str, Any],
             entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    folder = entry["path"]
    config_path, weights = paths[f"{folder}/config.json"], paths[f"{folder}/ae.pt"]
    cfg = {**dictionary_learning_config(read_config(config_path), str(config_path)),
           **(row.get("config_overrides") or {})}
    return cfg, dictionary_learning_tensors(read_torch(weights), cfg["architecture"], str(weights))


DICTIONARY_LEARNING_1 = ForeignKind("dictionary_learning_1", _files, _convert)
