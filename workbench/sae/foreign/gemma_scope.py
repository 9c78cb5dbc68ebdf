"""Gemma Scope (SAELens's ``gemma_2`` kind) and Gemma Scope 2 (``gemma_3``), converted as SAELens 6.54.12 does.

Gemma Scope stores one JumpReLU SAE per folder as ``params.npz`` (``W_enc [d_in, d_sae]``, ``W_dec``, ``b_enc``,
``b_dec``, ``threshold``: already SAELens's names and layout) with no config: SAELens reads the model and ``d_in``
from the repo id (``"2b"`` -> gemma-2-2b, 2304), ``d_sae`` from the folder (``width_16k``), the layer from
``layer_N`` and the hook from the repo's kind (``res``, ``mlp``, ``att``: ``attn.hook_z``, whose width is the heads'
total). An embedding SAE (``embedding/...``) reads ``hook_embed``, with its encoder divided and its decoder
multiplied by ``sqrt(d_in)`` (Gemma scales its embeddings by that; the SAE was trained on the unscaled ones).

Gemma Scope 2 stores ``params.safetensors`` (lower-case ``w_enc``, ``w_dec``; a transcoder's affine skip as
``affine_skip_connection [d_in, d_out]``) and a ``config.json`` where the repo has one; where it has none, SAELens
infers that config from the repo id and folder, as here. The widths come from the weights; a cross-layer
transcoder's (``clt``) decoder is summed over the layers it writes.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from workbench.errors import CheckpointError, ConfigError
from workbench.sae.foreign.kinds import ForeignKind, read_config, read_npz, read_safetensors

# SAELens's tables, in its order (the first key found in the name wins: "2b-it" before "2b").
GEMMA_2_WIDTHS = {"width_4k": 4096, "width_16k": 16384, "width_32k": 32768, "width_65k": 65536,
                  "width_131k": 131072, "width_262k": 262144, "width_524k": 524288, "width_1m": 1048576}
GEMMA_2_MODELS = {"2b-it": ("gemma-2-2b-it", 2304), "9b-it": ("gemma-2-9b-it", 3584),
                  "27b-it": ("gemma-2-27b-it", 4608), "2b": ("gemma-2-2b", 2304), "9b": ("gemma-2-9b", 3584),
                  "27b": ("gemma-2-27b", 4608)}
# An attention SAE reads hook_z flattened: the heads' total width, not d_model (SAELens keys this by "2b"/"9b"/"27b"
# only, so an "-it" repo keeps d_model, as there).
GEMMA_2_ATTENTION_WIDTHS = {"2b": 2048, "9b": 4096, "27b": 4608}
# What Gemma Scope's training config held, as SAELens states it.
_GEMMA_2_FIXED = {"architecture": "jumprelu", "dtype": "float32", "hook_head_index": None, "activation_fn": "relu",
                  "finetuning_scaling_factor": False, "sae_lens_training_version": None, "prepend_bos": True,
                  "dataset_path": "monology/pile-uncopyrighted", "context_size": 1024,
                  "dataset_trust_remote_code": True, "apply_b_dec_to_input": False, "normalize_activations": None}
_GEMMA_3_FIXED = {"dtype": "float32", "hook_head_index": None, "finetuning_scaling_factor": False,
                  "sae_lens_training_version": None, "prepend_bos": True,
                  "dataset_path": "monology/pile-uncopyrighted", "context_size": 1024, "apply_b_dec_to_input": False,
                  "normalize_activations": "none", "reshape_activations": "none"}


def gemma_2_config(repo_id: str, folder: str, overrides: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """SAELens's config of the Gemma Scope SAE in ``folder`` of ``repo_id`` (a pre-6.0 config: flat metadata),
    ``overrides`` (the release's ``config_overrides``) laid over it; a name SAELens cannot read is a ``ConfigError``.

    Example:
        >>> cfg = gemma_2_config("google/gemma-scope-2b-pt-att", "layer_3/width_16k/average_l0_20")
        >>> cfg["model_name"], cfg["d_in"], cfg["d_sae"], cfg["hook_name"]
        ('gemma-2-2b', 2048, 16384, 'blocks.3.attn.hook_z')
        >>> gemma_2_config("google/gemma-scope-9b-pt-res", "embedding/width_4k/average_l0_6")["hook_name"]
        'hook_embed'
    """
    match = re.search(r"layer_(\d+)", folder)
    if match is None and "embedding" not in folder:
        raise ConfigError(f"{repo_id}/{folder}: no layer_N in the folder name (SAELens reads the layer from it)")
    layer = int(match.group(1)) if match else 0
    model_key = next((key for key in GEMMA_2_MODELS if key in repo_id), None)
    if model_key is None:
        raise ConfigError(f"{repo_id}: no Gemma 2 size ({', '.join(GEMMA_2_MODELS)}) in the repo id (SAELens reads "
                          "the model and d_in from it)")
    model_name, d_in = GEMMA_2_MODELS[model_key]
    if "res" in repo_id:
        hook_name = "hook_embed" if "embedding" in folder else f"blocks.{layer}.hook_resid_post"
    elif "mlp" in repo_id:
        hook_name = f"blocks.{layer}.hook_mlp_out"
    elif "att" in repo_id:
        hook_name, d_in = f"blocks.{layer}.attn.hook_z", GEMMA_2_ATTENTION_WIDTHS.get(model_key, d_in)
    else:
        raise ConfigError(f"{repo_id}: neither 'res', 'mlp' nor 'att' in the repo id (SAELens reads the hook from it)")
    d_sae = next((width for key, width in GEMMA_2_WIDTHS.items() if key in folder), None)
    cfg = {**_GEMMA_2_FIXED, "d_in": d_in, "d_sae": d_sae, "model_name": model_name, "hook_name": hook_name,
           **(overrides or {})}
    if cfg["d_sae"] is None:
        raise ConfigError(f"{repo_id}/{folder}: no width ({', '.join(GEMMA_2_WIDTHS)}) in the folder name (SAELens "
                          "reads d_sae from it)")
    return cfg


def gemma_2_tensors(arrays: Mapping[str, Tensor], d_in: int, embedding: bool, source: str) -> dict[str, Tensor]:
    """SAELens's tensors from a ``params.npz``'s arrays: ``w_*`` renamed ``W_*``, float32, an all-ones
    ``scaling_factor`` dropped (another one refused, as SAELens 6 does), an embedding SAE rescaled by ``sqrt(d_in)``.

    Example:
        >>> out = gemma_2_tensors({"W_enc": torch.ones(4, 2), "w_dec": torch.ones(2, 4), "threshold": torch.zeros(2)},
        ...                       d_in=4, embedding=True, source="params.npz")
        >>> out["W_enc"][0, 0].item(), out["W_dec"][0, 0].item(), sorted(out)
        (0.5, 2.0, ['W_dec', 'W_enc', 'threshold'])
    """
    odd = sorted(name for name, array in arrays.items() if array.is_complex() or array.dtype == torch.bool)
    if odd:  # SAELens casts every array to float32; a complex one would lose its imaginary part unnoticed
        raise CheckpointError(f"{source}: arrays {odd} are not real numbers (Gemma Scope stores float32 weights)")
    tensors = {("W_" + name[2:] if name.startswith("w_") else name): array.to(torch.float32)
               for name, array in arrays.items()}
    scale = tensors.pop("scaling_factor", None)
    if scale is not None and not torch.allclose(scale, torch.ones_like(scale)):
        raise CheckpointError(f"{source}: 'scaling_factor' is not all ones: a fine-tuning scaling factor is not "
                              "supported (SAELens 6 refuses it too)")
    if embedding and "W_enc" in tensors and "W_dec" in tensors:
        tensors["W_enc"] = tensors["W_enc"] / math.sqrt(d_in)
        tensors["W_dec"] = tensors["W_dec"] * math.sqrt(d_in)
    return tensors


def _gemma_2_files(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    return [f"{folder}/params.npz"]


def _gemma_2_convert(paths: Mapping[str, Path], row: Mapping[str, Any],
                     entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    folder = entry["path"]
    cfg = gemma_2_config(row["repo_id"], folder, row.get("config_overrides"))
    path = paths[f"{folder}/params.npz"]
    return cfg, gemma_2_tensors(read_npz(path), cfg["d_in"], "embedding" in folder, str(path))


def gemma_3_inferred_config(repo_id: str, folder: str) -> dict[str, Any]:
    """The ``config.json`` SAELens infers for a Gemma Scope 2 folder that has none.

    Example:
        >>> gemma_3_inferred_config("google/gemma-scope-2-1b-pt", "transcoder/layer_7_width_16k_l0_big_affine")
        ... # doctest: +NORMALIZE_WHITESPACE
        {'architecture': 'jump_relu', 'model_name': 'google/gemma-3-1b-pt',
         'hf_hook_point_in': 'model.layers.7.pre_feedforward_layernorm.output', 'affine_connection': True,
         'hf_hook_point_out': 'model.layers.7.post_feedforward_layernorm.output'}
    """
    layer = _gemma_3_layer(repo_id, folder)
    transcoder = "transcoder" in folder or "clt" in folder
    if transcoder:
        hook_in, hook_out = (f"model.layers.{layer}.pre_feedforward_layernorm.output",
                             f"model.layers.{layer}.post_feedforward_layernorm.output")
    elif "resid_post" in folder:
        hook_in, hook_out = f"model.layers.{layer}.output", None
    elif "attn_out" in folder:
        hook_in, hook_out = f"model.layers.{layer}.self_attn.o_proj.input", None
    elif "mlp_out" in folder:
        hook_in, hook_out = f"model.layers.{layer}.post_feedforward_layernorm.output", None
    else:
        raise ConfigError(f"{repo_id}/{folder}: no hook kind (transcoder, clt, resid_post, attn_out, mlp_out) in the "
                          "folder name")
    raw: dict[str, Any] = {"architecture": "jump_relu", "model_name": repo_id.replace("gemma-scope-2", "gemma-3"),
                           "hf_hook_point_in": hook_in}
    if transcoder:
        raw["affine_connection"] = "affine" in folder
    if hook_out is not None:
        raw["hf_hook_point_out"] = hook_out
    return raw


def gemma_3_config(raw: Mapping[str, Any], folder: str, shapes: Mapping[str, tuple[int, ...]],
                   overrides: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """SAELens's config of a Gemma Scope 2 SAE from its ``config.json`` (or the inferred one), its folder and its
    tensors' shapes (``w_enc [d_in, d_sae]``, ``w_dec [..., d_out]``), ``overrides`` laid over it.

    Example:
        >>> raw = {"architecture": "jump_relu", "model_name": "gemma-v3-270m-pt", "hf_hook_point_in": "x"}
        >>> cfg = gemma_3_config(raw, "resid_post/layer_5_width_16k_l0_small", {"w_enc": (640, 16384)})
        >>> cfg["model_name"], cfg["hook_name"], cfg["d_in"], cfg["d_sae"], cfg["architecture"]
        ('google/gemma-3-270m', 'blocks.5.hook_resid_post', 640, 16384, 'jumprelu')
    """
    if raw.get("architecture") != "jump_relu":
        raise ConfigError(f"{folder}: a Gemma Scope 2 config's 'architecture' must be 'jump_relu', got "
                          f"{raw.get('architecture')!r}")
    layer = _gemma_3_layer("", folder)
    transcoder = "transcoder" in folder or "clt" in folder
    hook_name_out = None
    if "resid_post" in folder:
        hook_name = f"blocks.{layer}.hook_resid_post"
    elif "attn_out" in folder:
        hook_name = f"blocks.{layer}.attn.hook_z"
    elif "mlp_out" in folder:
        hook_name = f"blocks.{layer}.hook_mlp_out"
    elif transcoder:
        hook_name, hook_name_out = f"blocks.{layer}.hook_mlp_in", f"blocks.{layer}.hook_mlp_out"
    else:
        raise ConfigError(f"{folder}: no hook kind (resid_post, attn_out, mlp_out, transcoder, clt) in the folder name")
    if "w_enc" not in shapes or len(shapes["w_enc"]) != 2:
        raise CheckpointError(f"{folder}: no two-axis 'w_enc' tensor (Gemma Scope 2 stores w_enc [d_in, d_sae])")
    d_in, d_sae = shapes["w_enc"]
    model_name = raw.get("model_name")
    if not isinstance(model_name, str):
        raise ConfigError(f"{folder}: a Gemma Scope 2 config's 'model_name' must be a string, got {model_name!r}")
    model_name = ("google/" + model_name if "google" not in model_name else model_name).replace("-v3", "-3")
    if "270m" in model_name:  # the 270m model's Hub name has no -pt suffix
        model_name = model_name.replace("-pt", "")
    architecture = "jumprelu"
    if transcoder:
        architecture = "jumprelu_skip_transcoder" if raw.get("affine_connection", False) else "jumprelu_transcoder"
    cfg = {**_GEMMA_3_FIXED, "architecture": architecture, "d_in": d_in, "d_sae": d_sae, "model_name": model_name,
           "hook_name": hook_name, "hf_hook_name": raw.get("hf_hook_point_in")}
    if hook_name_out is not None:
        cfg.update(hook_name_out=hook_name_out, hf_hook_name_out=raw.get("hf_hook_point_out"))
    if transcoder:
        if "w_dec" not in shapes or not shapes["w_dec"]:
            raise CheckpointError(f"{folder}: no 'w_dec' tensor (a transcoder's output width is its last axis)")
        cfg["d_out"] = shapes["w_dec"][-1]
    return {**cfg, **(overrides or {})}


def gemma_3_params_file(folder: str) -> str:
    """The repo file holding a Gemma Scope 2 folder's weights (a cross-layer transcoder's sits beside its name).

    Example:
        >>> gemma_3_params_file("resid_post/layer_5_width_16k_l0_small"), gemma_3_params_file("clt/layer_3_width_16k")
        ('resid_post/layer_5_width_16k_l0_small/params.safetensors', 'clt/layer_3_width_16k.safetensors')
    """
    return f"{folder}.safetensors" if "clt" in folder else f"{folder}/params.safetensors"


def _gemma_3_files(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    return [gemma_3_params_file(folder)]


def _gemma_3_optional(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    return [f"{folder}/config.json"]  # SAELens tries it, and infers the config from the names where it is absent


def _gemma_3_convert(paths: Mapping[str, Path], row: Mapping[str, Any],
                     entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    folder, repo_id = entry["path"], row["repo_id"]
    config = paths.get(f"{folder}/config.json")
    raw = read_config(config) if config is not None else gemma_3_inferred_config(repo_id, folder)
    params_path = paths[gemma_3_params_file(folder)]
    loaded = {name: tensor.to(torch.float32) for name, tensor in read_safetensors(params_path).items()}
    cfg = gemma_3_config(raw, folder, {name: tuple(t.shape) for name, t in loaded.items()},
                         row.get("config_overrides"))
    missing = [name for name in ("w_enc", "w_dec", "b_enc", "b_dec", "threshold") if name not in loaded]
    if missing:
        raise CheckpointError(f"{params_path}: missing {', '.join(map(repr, missing))} (Gemma Scope 2 stores w_enc, "
                              "w_dec, b_enc, b_dec, threshold)")
    w_dec = loaded["w_dec"].sum(dim=1).contiguous() if "clt" in folder else loaded["w_dec"]
    tensors = {"W_enc": loaded["w_enc"], "W_dec": w_dec, "b_enc": loaded["b_enc"], "b_dec": loaded["b_dec"],
               "threshold": loaded["threshold"]}
    if "affine_skip_connection" in loaded:  # stored [d_in, d_out]; SAELens's W_skip is [d_out, d_in]
        tensors["W_skip"] = loaded["affine_skip_connection"].T.contiguous()
    return cfg, tensors


def _gemma_3_layer(repo_id: str, folder: str) -> int:
    match = re.search(r"layer_(\d+)", folder)
    if match is None:
        raise ConfigError(f"{repo_id + '/' if repo_id else ''}{folder}: no layer_N in the folder name (SAELens reads "
                          "the layer from it)")
    return int(match.group(1))


GEMMA_2 = ForeignKind("gemma_2", _gemma_2_files, _gemma_2_convert)
GEMMA_3 = ForeignKind("gemma_3", _gemma_3_files, _gemma_3_convert, _gemma_3_optional)
