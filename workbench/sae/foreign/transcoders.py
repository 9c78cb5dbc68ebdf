"""SAELens's three transcoder conversion kinds, as SAELens 6.54.12's loaders read them.

- ``gemma_2_transcoder`` (Gemma Scope transcoders): ``{folder}/params.npz``, already in SAELens's layout; ``d_in`` from
  the repo id ("2b" -> 2304, ...), ``d_sae`` from the folder ("width_16k" -> 16384), the layer from the folder.
- ``mwhanna_transcoder``: the folder is one circuit-tracer layer file (``layer_{i}.safetensors``, ``W_enc [F, D]``);
  sizes from ``wandb-config.yaml`` (``wanb-config.yaml`` in some repos), the model from ``config.yaml`` (absent in
  the Qwen3-14B repos: from the repo id). SAELens loads these as plain ``transcoder``s and refuses a file with
  ``W_skip`` or a JumpReLU threshold; here those load as ``skip_transcoder`` / ``jumprelu_transcoder``, as
  circuit-tracer computes them.
- ``mntss_clt_layer_transcoder``: one layer of a circuit-tracer cross-layer transcoder as a per-layer ``transcoder``,
  its decoders to every later layer summed and its threshold dropped (SAELens warns: for finding feature
  activations, not for reconstruction); sizes from the file's own ``b_enc`` / ``b_dec`` (SAELens reads them with
  raw range requests; here from the file fetched anyway), hooks and model from ``config.yaml``.

circuit-tracer's layout is converted by the one converter, ``workbench.transcoders.layout``. Which of mwhanna's
config files a repo holds is asked of ``workbench.hub`` (SAELens finds out by trying a download).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from workbench.errors import CheckpointError, ConfigError, InputError
from workbench.sae.foreign.kinds import ForeignKind, read_npz, read_safetensors
from workbench.transcoders.yaml_config import read_config as read_yaml

# SAELens's get_gemma_2_transcoder_config_from_hf tables, in its order (the first key found in the name wins).
GEMMA_WIDTHS = {"width_4k": 4096, "width_16k": 16384, "width_65k": 65536, "width_262k": 262144,
                "width_524k": 524288, "width_1m": 1048576}
GEMMA_MODELS = {"2b-it": ("gemma-2-2b-it", 2304), "2b": ("gemma-2-2b", 2304), "9b-it": ("gemma-2-9b-it", 3584),
                "9b": ("gemma-2-9b", 3584), "27b-it": ("gemma-2-27b-it", 4608), "27b": ("gemma-2-27b", 4608)}
# Gemma Scope's array names, any case, as SAELens maps them.
GEMMA_NAMES = {"w_enc": "W_enc", "wenc": "W_enc", "w_e": "W_enc", "w_dec": "W_dec", "wdec": "W_dec", "w_d": "W_dec",
               "b_enc": "b_enc", "benc": "b_enc", "b_e": "b_enc", "b_dec": "b_dec", "bdec": "b_dec", "b_d": "b_dec",
               "threshold": "threshold"}
WANDB_CONFIGS = ("wandb-config.yaml", "wanb-config.yaml")  # the second a typo some mwhanna repos carry
BASE_CONFIG = "config.yaml"
CLT_WARNING = ("This loads the CLT layer as a single layer transcoder by summing all decoders together. This should "
               "only be used to find feature activations, not for reconstruction")


# ---- gemma_2_transcoder ----------------------------------------------------------------------------------------
def gemma_2_transcoder_config(repo_id: str, folder: str) -> dict[str, Any]:
    """SAELens's config for a Gemma Scope transcoder, from the names alone.

    Example:
        >>> cfg = gemma_2_transcoder_config("google/gemma-scope-2b-pt-transcoders", "layer_3/width_16k/average_l0_54")
        >>> cfg["architecture"], cfg["d_in"], cfg["d_sae"], cfg["hook_name"], cfg["hook_name_out"]
        ('jumprelu_transcoder', 2304, 16384, 'blocks.3.ln2.hook_normalized', 'blocks.3.hook_mlp_out')
    """
    d_sae = next((width for key, width in GEMMA_WIDTHS.items() if key in folder), None)
    if d_sae is None:
        match = re.search(r"width_(\d+)k", folder)
        if not match:
            raise ConfigError(f"{repo_id}/{folder}: no dictionary size in the folder name (width_16k, ...)")
        d_sae = int(match.group(1)) * 1024
    layer = re.search(r"layer_(\d+)", folder) or re.search(r"layer_(\d+)", repo_id)
    if layer is None:
        raise ConfigError(f"{repo_id}/{folder}: no layer index (layer_N) in the folder or repo name")
    model = next((found for key, found in GEMMA_MODELS.items() if key in repo_id), None)
    if model is None:
        raise ConfigError(f"{repo_id}: not a Gemma 2 size SAELens knows (one of {', '.join(GEMMA_MODELS)})")
    (model_name, d_model), layer_index = model, int(layer.group(1))
    return {"architecture": "jumprelu_transcoder", "d_in": d_model, "d_out": d_model, "d_sae": d_sae,
            "dtype": "float32", "device": "cpu", "activation_fn": "relu", "normalize_activations": "none",
            "model_name": model_name, "hook_name": f"blocks.{layer_index}.ln2.hook_normalized",
            "hook_name_out": f"blocks.{layer_index}.hook_mlp_out", "hook_head_index": None,
            "hook_head_index_out": None, "prepend_bos": True, "dataset_path": "monology/pile-uncopyrighted",
            "context_size": 1024, "apply_b_dec_to_input": False}


def _gemma_2_files(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    gemma_2_transcoder_config(row["repo_id"], folder)  # names it cannot read sizes from: refused before a download
    return [f"{folder}/params.npz"]


def _gemma_2_convert(paths: Mapping[str, Path], row: Mapping[str, Any], entry: Mapping[str, Any]):
    cfg = gemma_2_transcoder_config(row["repo_id"], entry["path"])
    tensors = {GEMMA_NAMES[name.lower()]: array.to(torch.float32)
               for name, array in read_npz(paths[f"{entry['path']}/params.npz"]).items()
               if name.lower() in GEMMA_NAMES}
    return cfg, tensors


# ---- mwhanna_transcoder ----------------------------------------------------------------------------------------
def _mwhanna_files(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    from workbench.hub.transcoder_sources import files_held  # which config files this repo holds

    _layer_of(row["repo_id"], folder)  # a file name without a layer: refused before a download
    held = files_held(row["repo_id"], [*WANDB_CONFIGS, BASE_CONFIG])
    wandb = WANDB_CONFIGS[1] if WANDB_CONFIGS[1] in held and WANDB_CONFIGS[0] not in held else WANDB_CONFIGS[0]
    return [wandb, *([BASE_CONFIG] if BASE_CONFIG in held else []), folder]


def mwhanna_transcoder_config(repo_id: str, folder: str, wandb: Any, base: Optional[Any]) -> dict[str, Any]:
    """SAELens's config for an mwhanna transcoder: sizes from its wandb config, the model from ``config.yaml``
    (``base``; None: from a "qwen3-<size>b" repo id).

    Example:
        >>> cfg = mwhanna_transcoder_config("mwhanna/qwen3-14b-transcoders", "layer_5.safetensors",
        ...     {"d_model": {"value": 8}, "d_feature": {"value": 32}, "batch_size": {"value": 4096}}, None)
        >>> cfg["model_name"], cfg["d_sae"], cfg["hook_name"], cfg["hook_name_out"]
        ('Qwen/Qwen3-14B', 32, 'blocks.5.mlp.hook_in', 'blocks.5.hook_mlp_out')
    """
    layer = _layer_of(repo_id, folder)
    if base is None:
        size = re.search(r"qwen3-(\d+(?:\.\d+)?)b", repo_id)
        if not size:
            raise ConfigError(f"{repo_id}: no {BASE_CONFIG}, and no Qwen3 size in the repo id to name the model")
        model_name = f"Qwen/Qwen3-{size.group(1)}B"
    else:
        model_name = _field(base, ("model_name",), f"{repo_id}/{BASE_CONFIG}")
    where = f"{repo_id}/wandb-config.yaml"
    d_model = _field(wandb, ("d_model", "value"), where)
    return {"architecture": "transcoder", "d_in": d_model, "d_out": d_model,
            "d_sae": _field(wandb, ("d_feature", "value"), where), "dtype": "float32", "device": "cpu",
            "activation_fn": "relu", "normalize_activations": "none", "model_name": model_name,
            "hook_name": f"blocks.{layer}.mlp.hook_in", "hook_name_out": f"blocks.{layer}.hook_mlp_out",
            "dataset_path": "monology/pile-uncopyrighted",
            "context_size": _field(wandb, ("batch_size", "value"), where),
            "apply_b_dec_to_input": False, "model_from_pretrained_kwargs": {"fold_ln": False}}


def _layer_of(repo_id: str, folder: str) -> int:
    try:
        return int(folder.replace(".safetensors", "").split("_")[-1])
    except ValueError:
        raise ConfigError(f"{repo_id}/{folder}: no layer index at the end of the file name (layer_N.safetensors)") \
            from None


def _mwhanna_convert(paths: Mapping[str, Path], row: Mapping[str, Any], entry: Mapping[str, Any]):
    wandb = read_yaml(next(paths[name] for name in WANDB_CONFIGS if name in paths))
    base = read_yaml(paths[BASE_CONFIG]) if BASE_CONFIG in paths else None
    cfg = mwhanna_transcoder_config(row["repo_id"], entry["path"], wandb, base)
    source = paths[entry["path"]]
    stored = {name: tensor.to(torch.float32) for name, tensor in read_safetensors(source).items()}
    names = {"W_enc", "W_dec", "b_enc", "b_dec"}
    _expect(stored, names, {"W_skip", "activation_function.threshold"}, source)
    tensors = _from_circuit_tracer(stored["W_enc"], stored["b_enc"], stored.get("activation_function.threshold"),
                                   stored["W_dec"][:, None], stored["b_dec"], stored.get("W_skip"), cfg, source)
    cfg["architecture"] = tensors.pop("architecture")
    return cfg, tensors


# ---- mntss_clt_layer_transcoder --------------------------------------------------------------------------------
def _clt_layer_files(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    return [BASE_CONFIG, f"W_enc_{folder}.safetensors", f"W_dec_{folder}.safetensors"]


def _clt_layer_convert(paths: Mapping[str, Path], row: Mapping[str, Any], entry: Mapping[str, Any]):
    warnings.warn(CLT_WARNING, UserWarning, stacklevel=2)
    layer = entry["path"]
    base = read_yaml(paths[BASE_CONFIG])
    where = f"{row['repo_id']}/{BASE_CONFIG}"
    enc_path, dec_path = paths[f"W_enc_{layer}.safetensors"], paths[f"W_dec_{layer}.safetensors"]
    enc = {name: tensor.to(torch.float32) for name, tensor in read_safetensors(enc_path).items()}
    dec = {name: tensor.to(torch.float32) for name, tensor in read_safetensors(dec_path).items()}
    _expect(enc, {f"W_enc_{layer}", f"b_enc_{layer}", f"b_dec_{layer}"}, {f"threshold_{layer}"}, enc_path)
    _expect(dec, {f"W_dec_{layer}"}, set(), dec_path)
    if dec[f"W_dec_{layer}"].dim() != 3:
        raise CheckpointError(f"{dec_path}: tensor 'W_dec_{layer}' has shape {tuple(dec[f'W_dec_{layer}'].shape)}; "
                              "expected [d_transcoder, n_layers - layer, d_model]")
    d_in, d_sae = enc[f"b_dec_{layer}"].shape[0], enc[f"b_enc_{layer}"].shape[0]
    cfg = {"architecture": "transcoder", "d_in": d_in, "d_out": d_in, "d_sae": d_sae, "dtype": "float32",
           "device": "cpu", "activation_fn": "relu", "normalize_activations": "none",
           "model_name": _field(base, ("model_name",), where),
           "hook_name": f"blocks.{layer}.{_field(base, ('feature_input_hook',), where)}",
           "hook_name_out": f"blocks.{layer}.{_field(base, ('feature_output_hook',), where)}",
           "apply_b_dec_to_input": False, "model_from_pretrained_kwargs": {"fold_ln": False}}
    summed = dec[f"W_dec_{layer}"].sum(dim=1, keepdim=True)  # every later layer's decoder, summed (SAELens)
    tensors = _from_circuit_tracer(enc[f"W_enc_{layer}"], enc[f"b_enc_{layer}"], None, summed,
                                   enc[f"b_dec_{layer}"], None, cfg, enc_path)
    tensors.pop("architecture")
    return cfg, tensors


# ---- shared ----------------------------------------------------------------------------------------------------
def _from_circuit_tracer(W_enc: Tensor, b_enc: Tensor, threshold: Optional[Tensor], W_dec: Tensor, b_dec: Tensor,
                         W_skip: Optional[Tensor], cfg: dict[str, Any], source: Path) -> dict[str, Any]:
    """One layer in circuit-tracer's layout (``W_enc [F, D]``, ``W_dec [F, 1, D]``) as SAELens's tensors, through
    the one converter, with the architecture its tensors make."""
    from workbench.transcoders.layout import from_circuit_tracer_layout  # builds SAEs: imported when called

    try:
        [sae] = from_circuit_tracer_layout([W_enc], [b_enc], [threshold], [W_dec], b_dec[None],
                                           None if W_skip is None else [W_skip],
                                           lambda layer: (cfg["hook_name"], cfg["hook_name_out"]))
    except InputError as error:
        raise CheckpointError(f"{source}: {error}") from None
    return {"architecture": sae.cfg.architecture(),
            **{name: parameter.detach() for name, parameter in sae.named_parameters()}}


def _expect(tensors: Mapping[str, Tensor], required: set[str], optional: set[str], source: Path) -> None:
    missing, extra = sorted(required - set(tensors)), sorted(set(tensors) - required - optional)
    if missing or extra:
        raise CheckpointError(f"{source}: " + "; ".join(
            ([f"missing tensor {', '.join(map(repr, missing))}"] if missing else [])
            + ([f"unexpected tensor {', '.join(map(repr, extra))}"] if extra else [])))


def _field(config: Any, keys: tuple[str, ...], where: str) -> Any:
    value = config
    for key in keys:
        if not isinstance(value, Mapping) or key not in value:
            raise ConfigError(f"{where}: field {'.'.join(keys)!r} is missing")
        value = value[key]
    return value


GEMMA_2_TRANSCODER = ForeignKind("gemma_2_transcoder", _gemma_2_files, _gemma_2_convert)
MWHANNA_TRANSCODER = ForeignKind("mwhanna_transcoder", _mwhanna_files, _mwhanna_convert)
MNTSS_CLT_LAYER_TRANSCODER = ForeignKind("mntss_clt_layer_transcoder", _clt_layer_files, _clt_layer_convert)
TRANSCODER_KINDS = (GEMMA_2_TRANSCODER, MWHANNA_TRANSCODER, MNTSS_CLT_LAYER_TRANSCODER)
