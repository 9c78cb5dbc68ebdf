"""SAELens's ``deepseek_r1`` and ``qwen_scope`` kinds: one pickled state dict per SAE, the config from names.

Both store a release's SAE as a single ``.pt`` file (the registry's path is the file itself) and carry no config:
SAELens 6.54.12 writes one from the names, and so does this module.

- ``deepseek_r1`` (qresearch's SAEs on DeepSeek-R1-Distill-Llama-8B): the layer from ``l<N>`` in the file name,
  the sizes fixed (d_in 4096, d_sae 65536); tensors ``encoder.weight [d_sae, d_in]``, ``encoder.bias``,
  ``decoder.weight [d_in, d_sae]``, ``decoder.bias`` (``torch.nn.Linear``'s layout: both weights transposed).
- ``qwen_scope`` (Qwen's top-k SAEs): the model, width and k from the repo id
  (``Qwen/SAE-Res-{model}-W{N}K-L0_{k}``: d_sae = N * 1024), d_in from the model, the layer from
  ``layer<N>.sae.pt``; tensors ``W_enc [d_sae, d_in]``, ``W_dec [d_in, d_sae]`` (both transposed), ``b_enc``,
  ``b_dec``.

The registry's ``config_overrides`` are laid over these configs by the caller, as SAELens lays them. SAELens's
``from_pretrained`` replaces the loader's dtype by its own ``dtype`` argument (float32 unless asked), so the
config here says float32 and ``load_sae``'s ``dtype=`` chooses another.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from torch import Tensor

from workbench.errors import ConfigError
from workbench.sae.foreign.kinds import ForeignKind
from workbench.sae.foreign.state_dicts import pt_tensors

# SAELens's ``from_pretrained`` default dtype, which replaces whatever its loader wrote.
FROM_PRETRAINED_DTYPE = "float32"

# The model named inside a Qwen Scope repo id -> (its HF repo, its hidden size) (SAELens's QWEN_SCOPE_MODEL_INFO).
QWEN_SCOPE_MODELS: dict[str, tuple[str, int]] = {
    "Qwen3-1.7B-Base": ("Qwen/Qwen3-1.7B-Base", 2048),
    "Qwen3-8B-Base": ("Qwen/Qwen3-8B-Base", 4096),
    "Qwen3-30B-A3B-Base": ("Qwen/Qwen3-30B-A3B-Base", 2048),
    "Qwen3.5-2B-Base": ("Qwen/Qwen3.5-2B-Base", 2048),
    "Qwen3.5-9B-Base": ("Qwen/Qwen3.5-9B-Base", 4096),
    "Qwen3.5-27B": ("Qwen/Qwen3.5-27B", 5120),
    "Qwen3.5-35B-A3B-Base": ("Qwen/Qwen3.5-35B-A3B-Base", 2048),
}


def deepseek_r1_config(folder: str) -> dict[str, Any]:
    """SAELens's config for a DeepSeek R1 SAE file (its ``get_deepseek_r1_config_from_hf``, on the CPU).

    Example:
        >>> cfg = deepseek_r1_config("DeepSeek-R1-Distill-Llama-8B-SAE-l19.pt")
        >>> cfg["hook_name"], cfg["d_in"], cfg["d_sae"], cfg["apply_b_dec_to_input"]
        ('blocks.19.hook_resid_post', 4096, 65536, False)
    """
    match = re.search(r"l(\d+)", folder)
    if match is None:
        raise ConfigError(f"{folder}: a DeepSeek R1 SAE file names its layer as l<N> (SAELens reads it there)")
    return {"architecture": "standard", "d_in": 4096, "d_sae": 4096 * 16, "dtype": "bfloat16", "context_size": 1024,
            "model_name": "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
            "hook_name": f"blocks.{int(match.group(1))}.hook_resid_post", "hook_head_index": None,
            "prepend_bos": True, "dataset_path": "lmsys/lmsys-chat-1m", "dataset_trust_remote_code": True,
            "sae_lens_training_version": None, "activation_fn": "relu", "normalize_activations": "none",
            "device": "cpu", "apply_b_dec_to_input": False, "finetuning_scaling_factor": False}


def qwen_scope_config(repo_id: str, folder: str) -> dict[str, Any]:
    """SAELens's config for a Qwen Scope SAE file (its ``get_qwen_scope_config_from_hf``, on the CPU).

    Example:
        >>> cfg = qwen_scope_config("Qwen/SAE-Res-Qwen3-1.7B-Base-W32K-L0_50", "layer3.sae.pt")
        >>> cfg["hook_name"], cfg["d_in"], cfg["d_sae"], cfg["activation_fn_kwargs"]
        ('blocks.3.hook_resid_post', 2048, 32768, {'k': 50})
    """
    layer = re.search(r"layer(\d+)\.sae\.pt", folder)
    if layer is None:
        raise ConfigError(f"{repo_id}/{folder}: a Qwen Scope SAE file is layer<N>.sae.pt (SAELens reads the layer there)")
    sizes = re.search(r"SAE-Res-(.+)-W(\d+)K-L0_(\d+)", repo_id)
    if sizes is None:
        raise ConfigError(f"{repo_id}: a Qwen Scope repo id is SAE-Res-<model>-W<N>K-L0_<k> (SAELens reads the "
                          "width and k there)")
    model_key, width_k, k = sizes.group(1), int(sizes.group(2)), int(sizes.group(3))
    if model_key not in QWEN_SCOPE_MODELS:
        raise ConfigError(f"{repo_id}: unknown Qwen Scope base model {model_key!r} (known: {sorted(QWEN_SCOPE_MODELS)})")
    model_name, d_in = QWEN_SCOPE_MODELS[model_key]
    n = int(layer.group(1))
    return {"architecture": "topk", "activation_fn": "topk", "activation_fn_kwargs": {"k": k}, "d_in": d_in,
            "d_sae": width_k * 1024, "dtype": "float32", "context_size": 1024, "model_name": model_name,
            "hook_name": f"blocks.{n}.hook_resid_post", "hf_hook_name": f"model.layers.{n}", "hook_head_index": None,
            "prepend_bos": True, "dataset_path": None, "sae_lens_training_version": None,
            "normalize_activations": "none", "device": "cpu", "apply_b_dec_to_input": False,
            "finetuning_scaling_factor": False}


def _deepseek_convert(paths: Mapping[str, Path], row: Mapping[str, Any],
                      entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    state = pt_tensors(paths[entry["path"]], ("encoder.weight", "encoder.bias", "decoder.weight", "decoder.bias"))
    tensors = {"W_enc": state["encoder.weight"].T.contiguous(), "W_dec": state["decoder.weight"].T.contiguous(),
               "b_enc": state["encoder.bias"], "b_dec": state["decoder.bias"]}
    return {**deepseek_r1_config(entry["path"]), "dtype": FROM_PRETRAINED_DTYPE}, tensors


def _qwen_convert(paths: Mapping[str, Path], row: Mapping[str, Any],
                  entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    cfg = qwen_scope_config(row["repo_id"], entry["path"])
    state = pt_tensors(paths[entry["path"]], ("W_enc", "W_dec", "b_enc", "b_dec"))
    tensors = {"W_enc": state["W_enc"].T.contiguous(), "W_dec": state["W_dec"].T.contiguous(),
               "b_enc": state["b_enc"], "b_dec": state["b_dec"]}
    return {**cfg, "dtype": FROM_PRETRAINED_DTYPE}, tensors


def _deepseek_files(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    deepseek_r1_config(folder)  # a name the config cannot be read from is refused before any download
    return [folder]


def _qwen_files(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    qwen_scope_config(row["repo_id"], folder)
    return [folder]


DEEPSEEK_R1 = ForeignKind("deepseek_r1", _deepseek_files, _deepseek_convert)
QWEN_SCOPE = ForeignKind("qwen_scope", _qwen_files, _qwen_convert)
