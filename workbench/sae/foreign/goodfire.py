"""SAELens's ``goodfire`` kind: Goodfire's Llama SAEs, one pickled ``torch.nn.Linear`` pair per repo.

The file holds ``encoder_linear.weight [d_sae, d_in]``, ``encoder_linear.bias``, ``decoder_linear.weight
[d_in, d_sae]`` and ``decoder_linear.bias``; SAELens 6.54.12 knows the config of exactly two repos (each with its
one file) and refuses any other, as this module does. The registry's ``config_overrides`` are laid over the config
by the caller; the dtype is SAELens's ``from_pretrained`` default, float32 (``load_sae``'s ``dtype=`` chooses).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from torch import Tensor

from workbench.errors import ConfigError
from workbench.sae.foreign.kinds import ForeignKind
from workbench.sae.foreign.state_dicts import pt_tensors

# (repo id, its file) -> (d_in, d_sae, model, layer): SAELens's get_goodfire_config_from_hf.
GOODFIRE_SAES: dict[tuple[str, str], tuple[int, int, str, int]] = {
    ("Goodfire/Llama-3.3-70B-Instruct-SAE-l50", "Llama-3.3-70B-Instruct-SAE-l50.pt"):
        (8192, 65536, "meta-llama/Llama-3.3-70B-Instruct", 50),
    ("Goodfire/Llama-3.1-8B-Instruct-SAE-l19", "Llama-3.1-8B-Instruct-SAE-l19.pth"):
        (4096, 65536, "meta-llama/Llama-3.1-8B-Instruct", 19),
}


def goodfire_config(repo_id: str, folder: str) -> dict[str, Any]:
    """SAELens's config for Goodfire SAE file ``folder`` of ``repo_id`` (its ``get_goodfire_config_from_hf``, CPU).

    Example:
        >>> cfg = goodfire_config("Goodfire/Llama-3.1-8B-Instruct-SAE-l19", "Llama-3.1-8B-Instruct-SAE-l19.pth")
        >>> cfg["hook_name"], cfg["d_in"], cfg["d_sae"]
        ('blocks.19.hook_resid_post', 4096, 65536)
        >>> goodfire_config("Goodfire/other", "sae.pt")
        Traceback (most recent call last):
        workbench.errors.ConfigError: Goodfire/other/sae.pt: not a Goodfire SAE SAELens knows ...
    """
    if (repo_id, folder) not in GOODFIRE_SAES:
        known = ", ".join(f"{repo}/{name}" for repo, name in GOODFIRE_SAES)
        raise ConfigError(f"{repo_id}/{folder}: not a Goodfire SAE SAELens knows the config of (known: {known})")
    d_in, d_sae, model_name, layer = GOODFIRE_SAES[(repo_id, folder)]
    return {"architecture": "standard", "d_in": d_in, "d_sae": d_sae, "model_name": model_name,
            "hook_name": f"blocks.{layer}.hook_resid_post", "hook_head_index": None,
            "dataset_path": "lmsys/lmsys-chat-1m", "apply_b_dec_to_input": False, "device": "cpu"}


def _files(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    goodfire_config(row["repo_id"], folder)  # an unknown SAE is refused before any download
    return [folder]


def _convert(paths: Mapping[str, Path], row: Mapping[str, Any],
             entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    cfg = goodfire_config(row["repo_id"], entry["path"])
    state = pt_tensors(paths[entry["path"]], ("encoder_linear.weight", "encoder_linear.bias",
                                              "decoder_linear.weight", "decoder_linear.bias"))
    tensors = {"W_enc": state["encoder_linear.weight"].T.contiguous(),
               "W_dec": state["decoder_linear.weight"].T.contiguous(),
               "b_enc": state["encoder_linear.bias"], "b_dec": state["decoder_linear.bias"]}
    return {**cfg, "dtype": "float32"}, tensors  # a pre-6.0 config: prepend_bos defaults to true when it is read


GOODFIRE = ForeignKind("goodfire", _files, _convert)
