"""SAELens's ``temporal`` kind: canrager's temporal SAEs (``canrager/temporalSAEs``), one folder per SAE.

A folder ``<model>/layer_<n>/temporal`` holds ``conf.yaml`` (``llm.dimin``, ``sae.exp_factor``, ``sae.n_heads``,
``n_attn_layers``, ``bottleneck_factor``, ``sae_diff_type``, ``kval_topk``, ``tied_weights``, ``scaling_factor``,
``data.dtype``) and ``latest_ckpt.safetensors`` (``D`` the decoder, ``b`` its bias, ``E`` the encoder when untied,
``attn_layers.*`` as SAELens names them). The config is SAELens's ``get_temporal_sae_config_from_hf``: the hook is
``blocks.<n>.hook_resid_post`` from the folder's ``layer_<n>``, the input ``constant_scalar_rescale``d by
``scaling_factor`` and ``b_dec`` applied to the input. The YAML is read through the bounded, alias-checked reader.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from torch import Tensor

from workbench.errors import CheckpointError, ConfigError
from workbench.sae.foreign.kinds import ForeignKind, read_safetensors
from workbench.transcoders.yaml_config import read_config as read_yaml

CONFIG_FILE, WEIGHTS_FILE = "conf.yaml", "latest_ckpt.safetensors"
# conf.yaml's ``sae`` fields copied into the config under the same names.
SAE_FIELDS = ("n_heads", "n_attn_layers", "bottleneck_factor", "sae_diff_type", "kval_topk", "tied_weights")


def temporal_config(conf: Any, folder: str) -> dict[str, Any]:
    """SAELens's config of the temporal SAE in ``folder`` whose parsed ``conf.yaml`` is ``conf``.

    Example:
        >>> conf = {"llm": {"dimin": 16}, "data": {"dtype": "float32"}, "sae": {"exp_factor": 4, "n_heads": 2,
        ...     "n_attn_layers": 1, "bottleneck_factor": 4, "sae_diff_type": "topk", "kval_topk": 8,
        ...     "tied_weights": True, "scaling_factor": 0.5}}
        >>> cfg = temporal_config(conf, "gemma-2-2B/layer_12/temporal")
        >>> cfg["hook_name"], cfg["d_sae"], cfg["activation_normalization_factor"]
        ('blocks.12.hook_resid_post', 64, 0.5)
        >>> temporal_config(conf, "gemma-2-2B/temporal")
        Traceback (most recent call last):
        workbench.errors.ConfigError: gemma-2-2B/temporal: a temporal SAE's folder names its layer (layer_N), as SAELens reads it
    """
    layer = re.search(r"layer_(\d+)", folder)
    if layer is None:
        raise ConfigError(f"{folder}: a temporal SAE's folder names its layer (layer_N), as SAELens reads it")
    sae, llm, data = (_section(conf, name, folder) for name in ("sae", "llm", "data"))
    d_in, exp_factor = _field(llm, "llm", "dimin", folder), _field(sae, "sae", "exp_factor", folder)
    if isinstance(d_in, bool) or not isinstance(d_in, int) or isinstance(exp_factor, bool) \
            or not isinstance(exp_factor, (int, float)):
        raise ConfigError(f"{folder}/{CONFIG_FILE}: llm.dimin must be an integer and sae.exp_factor a number, got "
                          f"{d_in!r} and {exp_factor!r}")
    return {"architecture": "temporal", "hook_name": f"blocks.{int(layer.group(1))}.hook_resid_post",
            "d_in": d_in, "d_sae": int(d_in * exp_factor),
            **{name: _field(sae, "sae", name, folder) for name in SAE_FIELDS},
            "dtype": _field(data, "data", "dtype", folder), "device": "cpu",
            "normalize_activations": "constant_scalar_rescale",
            "activation_normalization_factor": _field(sae, "sae", "scaling_factor", folder),
            "apply_b_dec_to_input": True}


def _section(conf: Any, name: str, folder: str) -> Mapping[str, Any]:
    section = conf.get(name) if isinstance(conf, Mapping) else None
    if not isinstance(section, Mapping):
        raise ConfigError(f"{folder}/{CONFIG_FILE}: no {name!r} section (a temporal SAE's conf.yaml has llm, sae, data)")
    return section


def _field(section: Mapping[str, Any], where: str, name: str, folder: str) -> Any:
    if name not in section:
        raise ConfigError(f"{folder}/{CONFIG_FILE}: no field {where}.{name}")
    return section[name]


def _files(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    return [f"{folder}/{CONFIG_FILE}", f"{folder}/{WEIGHTS_FILE}"]


def _convert(paths: Mapping[str, Path], row: Mapping[str, Any],
             entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    folder = entry["path"]
    cfg = temporal_config(read_yaml(paths[f"{folder}/{CONFIG_FILE}"]), folder)
    raw = read_safetensors(paths[f"{folder}/{WEIGHTS_FILE}"])
    missing = [name for name in ("D", "b") if name not in raw]
    if missing:
        raise CheckpointError(f"{folder}/{WEIGHTS_FILE}: missing {', '.join(map(repr, missing))} (a temporal SAE "
                              "stores D, b, attn_layers.* and, untied, E)")
    # SAELens keeps the attention layers and D, b, E under its names and drops anything else the file holds.
    tensors = {name: value for name, value in raw.items() if name.startswith("attn_layers.")}
    tensors.update(W_dec=raw["D"], b_dec=raw["b"])
    if "E" in raw:
        tensors["W_enc"] = raw["E"]
    return cfg, tensors


TEMPORAL = ForeignKind("temporal", _files, _convert)
