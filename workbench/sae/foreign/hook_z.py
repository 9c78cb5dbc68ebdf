"""SAELens's ``connor_rob_hook_z`` kind: Connor Kissane and Rob Krzyzanowski's attention-output SAEs on GPT-2 small.

Each SAE is a pickled state dict already in SAELens's names and layout (``W_enc [d_in, d_sae]``, ``W_dec``,
``b_enc``, ``b_dec``; the registry's path is the ``.pt`` file) beside a ``<name>_cfg.json`` of its training run,
of which SAELens 6.54.12 reads ``act_size`` (d_in: heads times d_head), ``dict_size`` (d_sae) and ``act_name``
(the ``hook_z`` hook). The SAE reads ``hook_z`` with its heads flattened (``reshape_activations: hook_z``,
handled by ``workbench.sae.math``: ``encode`` takes ``[..., heads, d_head]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from torch import Tensor

from workbench.errors import ConfigError
from workbench.sae.foreign.kinds import ForeignKind, read_config
from workbench.sae.foreign.state_dicts import pt_tensors


def hook_z_config_file(folder: str) -> str:
    """The run config beside SAE file ``folder``, named as SAELens names it.

    Example:
        >>> hook_z_config_file("gpt2-small_L0_Hcat_z_lr1.20e-03_v9.pt")
        'gpt2-small_L0_Hcat_z_lr1.20e-03_v9_cfg.json'
    """
    return folder.split(".pt")[0] + "_cfg.json"


def hook_z_config(run: Mapping[str, Any], source: str) -> dict[str, Any]:
    """SAELens's config for a hook_z SAE from its run config ``run`` (``get_connor_rob_hook_z_config_from_hf``).

    Example:
        >>> cfg = hook_z_config({"act_size": 768, "dict_size": 24576, "act_name": "blocks.0.attn.hook_z"}, "run")
        >>> cfg["d_in"], cfg["d_sae"], cfg["hook_name"], cfg["reshape_activations"]
        (768, 24576, 'blocks.0.attn.hook_z', 'hook_z')
        >>> hook_z_config({"act_size": 768}, "run_cfg.json")
        Traceback (most recent call last):
        workbench.errors.ConfigError: run_cfg.json: missing 'dict_size', 'act_name' (a hook_z SAE's run config names ...
    """
    missing = [name for name in ("act_size", "dict_size", "act_name") if name not in run]
    if missing:
        raise ConfigError(f"{source}: missing {', '.join(map(repr, missing))} (a hook_z SAE's run config names its "
                          "act_size, dict_size and act_name)")
    return {"architecture": "standard", "d_in": run["act_size"], "d_sae": run["dict_size"], "dtype": "float32",
            "device": "cpu", "model_name": "gpt2-small", "hook_name": run["act_name"], "hook_head_index": None,
            "activation_fn": "relu", "apply_b_dec_to_input": True, "finetuning_scaling_factor": False,
            "sae_lens_training_version": None, "prepend_bos": True, "dataset_path": "Skylion007/openwebtext",
            "context_size": 128, "normalize_activations": "none", "dataset_trust_remote_code": True,
            "reshape_activations": "hook_z"}


def _files(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    return [hook_z_config_file(folder), folder]


def _convert(paths: Mapping[str, Path], row: Mapping[str, Any],
             entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    run_path = paths[hook_z_config_file(entry["path"])]
    cfg = hook_z_config(read_config(run_path), str(run_path))
    return cfg, pt_tensors(paths[entry["path"]], ("W_enc", "W_dec", "b_enc", "b_dec"))


CONNOR_ROB_HOOK_Z = ForeignKind("connor_rob_hook_z", _files, _convert)
