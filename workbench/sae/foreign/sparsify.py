"""SAELens's ``sparsify`` kind: EleutherAI ``sparsify`` top-k SAEs, a folder with ``cfg.json`` and ``sae.safetensors``.

sparsify's ``cfg.json`` holds ``d_in``, ``num_latents`` (0: ``d_in * expansion_factor``), ``k``, ``signed``,
``normalize_decoder``; its weights are ``encoder.weight [d_sae, d_in]``, ``encoder.bias``, ``W_dec [d_sae, d_in]``
and ``b_dec``. A ``config.json`` in the folder's parent (the training run: ``model``, ``dataset``, ``ctx_len``)
is read when the caller fetched it. The hook is the folder's name: ``layers.<N>`` (or ``layers_<N>``) is
``blocks.<N>.hook_resid_post``, ``embed_tokens`` is ``hook_embed``.

The config is SAELens 6.54.12's (``get_sparsify_config_from_disk``) with four differences, each where SAELens's
would not compute what sparsify computes or would not load at all:

- ``W_dec`` is kept as stored: sparsify already stores it ``[d_sae, d_in]``; SAELens transposes it, and its SAE
  then refuses the file (a size mismatch) unless ``d_in == d_sae``.
- ``apply_b_dec_to_input`` is true: sparsify's ``encode`` subtracts ``b_dec`` from every SAE's input; SAELens
  sets it to ``not normalize_decoder``.
- ``num_latents: 0`` means ``d_in * expansion_factor``, as in sparsify (SAELens takes the 0).
- What a top-k SAE cannot honour is refused, naming the field: ``signed: true`` top-k, another ``activation``
  or ``architecture``, a transcoder (``transcode``) or a skip connection (``W_skip``), a hook folder other than
  the residual stream (``layers.3.mlp``). SAELens drops ``signed`` and reads every ``layers.<N>...`` folder as
  the residual stream.

With no ``config.json``, the model name is the folder's parent in the repo, or the repo's name for a folder at
its root (what SAELens's disk loader gives a local copy of the repo; on the Hub SAELens gives the snapshot's
commit). The dtype is float32, SAELens's ``from_pretrained`` default (its loader's bfloat16 is replaced).
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from workbench.errors import CheckpointError, ConfigError
from workbench.sae.foreign.kinds import ForeignKind, read_config, read_safetensors

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae.safetensors"  # SAELens's SPARSIFY_WEIGHTS_FILENAME
RUN_CONFIG_FILE = "config.json"


def run_config_file(folder: str) -> str:
    """The training run's config that sparsify writes beside the SAE folders (the folder's parent).

    Example:
        >>> run_config_file("layers.10"), run_config_file("sae-pythia/layers.3")
        ('config.json', 'sae-pythia/config.json')
    """
    parent = PurePosixPath(folder).parent
    return RUN_CONFIG_FILE if str(parent) in ("", ".") else f"{parent}/{RUN_CONFIG_FILE}"


def sparsify_config(coder: Mapping[str, Any], run: Mapping[str, Any], repo_id: str, folder: str,
                    source: str) -> dict[str, Any]:
    """The SAELens config (SAELens 5 layout, as its loader returns) of sparsify config ``coder`` in ``folder``,
    with the training run's config ``run`` (``{}`` when there is none); ``source`` prefixes errors.

    Example:
        >>> cfg = sparsify_config({"d_in": 8, "num_latents": 16, "k": 4}, {"model": "EleutherAI/pythia-70m"},
        ...                       "EleutherAI/sae-pythia-70m-32k", "layers.1", "cfg.json")
        >>> cfg["hook_name"], cfg["d_sae"], cfg["activation_fn_kwargs"], cfg["model_name"]
        ('blocks.1.hook_resid_post', 16, {'k': 4, 'signed': False}, 'EleutherAI/pythia-70m')
        >>> sparsify_config({"d_in": 8, "num_latents": 16, "k": 40}, {}, "org/saes", "layers.1", "cfg.json")
        Traceback (most recent call last):
        workbench.errors.ConfigError: cfg.json: field 'k' must be an integer from 1 to num_latents=16, got 40
    """
    d_in = _positive(coder, "d_in", source)
    d_sae = coder.get("num_latents") or _positive(coder, "expansion_factor", source) * d_in
    d_sae = _positive({"num_latents": d_sae}, "num_latents", source)
    k = coder.get("k")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d_sae:
        raise ConfigError(f"{source}: field 'k' must be an integer from 1 to num_latents={d_sae}, got {k!r}")
    for name, allowed in (("signed", (False, None)), ("transcode", (False, None)), ("skip_connection", (False, None)),
                          ("activation", ("topk", None)), ("architecture", ("topk", None))):
        if coder.get(name) not in allowed:
            raise ConfigError(f"{source}: field {name!r} is {coder[name]!r}; only a plain top-k SAE is loaded "
                              f"({name} must be {allowed[0]!r})")
    hook_name, layer = _hook(folder, source)
    parent = PurePosixPath(folder).parent.name
    return {"architecture": "standard", "d_in": d_in, "d_sae": d_sae, "dtype": "float32", "device": "cpu",
            "model_name": run.get("model", parent or repo_id.split("/")[-1]), "hook_name": hook_name,
            "hook_layer": layer, "hook_head_index": None, "activation_fn_str": "topk",
            "activation_fn_kwargs": {"k": k, "signed": bool(coder.get("signed", False))},
            "apply_b_dec_to_input": True,
            "dataset_path": run.get("dataset", "togethercomputer/RedPajama-Data-1T-Sample"),
            "context_size": run.get("ctx_len", 2048), "finetuning_scaling_factor": False,
            "sae_lens_training_version": None, "prepend_bos": True, "dataset_trust_remote_code": True,
            "normalize_activations": "none", "neuronpedia_id": None}


def sparsify_tensors(path: Path, d_in: int, d_sae: int) -> dict[str, Tensor]:
    """SAELens's tensors from a sparsify ``sae.safetensors`` (zero biases where the file has none).

    Example:
        >>> sparsify_tensors(Path("no/sae.safetensors"), 8, 16)
        Traceback (most recent call last):
        workbench.errors.CheckpointError: no/sae.safetensors: not a readable safetensors file ...
    """
    stored = read_safetensors(path)
    if "W_skip" in stored:
        raise ConfigError(f"{path}: holds 'W_skip', a skip connection; only a plain top-k SAE is loaded")
    w_enc = _first(stored, path, ("W_enc", False), ("encoder.weight", True))
    w_dec = _first(stored, path, ("W_dec", False), ("decoder.weight", True))
    b_enc = _optional(stored, ("b_enc", "encoder.bias"))
    b_dec = _optional(stored, ("b_dec", "decoder.bias"))
    return {"W_enc": w_enc, "W_dec": w_dec,
            "b_enc": b_enc if b_enc is not None else torch.zeros(d_sae, dtype=w_dec.dtype),
            "b_dec": b_dec if b_dec is not None else torch.zeros(d_in, dtype=w_dec.dtype)}


def _convert(paths: Mapping[str, Path], row: Mapping[str, Any],
             entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    folder = entry["path"]
    cfg_path = paths[f"{folder}/{CFG_FILE}"]
    run_path = paths.get(run_config_file(folder))
    cfg = sparsify_config(read_config(cfg_path), read_config(run_path) if run_path is not None else {},
                          row["repo_id"], folder, str(cfg_path))
    return cfg, sparsify_tensors(paths[f"{folder}/{WEIGHTS_FILE}"], cfg["d_in"], cfg["d_sae"])


def _files(folder: str, row: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    _hook(folder, f"{row['repo_id']}/{folder}")  # a folder that names no hook is refused before any download
    return [f"{folder}/{CFG_FILE}", f"{folder}/{WEIGHTS_FILE}"]


def _hook(folder: str, source: str) -> tuple[str, int]:
    name = PurePosixPath(folder).name
    if name == "embed_tokens":
        return "hook_embed", 0
    match = re.search(r"layers[._](\d+)", name)
    if match is None or name[match.end():]:
        raise ConfigError(f"{source}: a sparsify SAE folder is named layers.<N> (the residual stream after layer N) "
                          f"or embed_tokens, got {name!r}")
    return f"blocks.{int(match.group(1))}.hook_resid_post", int(match.group(1))


def _positive(values: Mapping[str, Any], name: str, source: str) -> int:
    value = values.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{source}: field {name!r} must be a positive integer, got {value!r}")
    return value


def _first(stored: Mapping[str, Tensor], path: Path, *names: tuple[str, bool]) -> Tensor:
    """The first of ``names`` the file holds (transposed where marked: ``torch.nn.Linear``'s layout)."""
    for name, transposed in names:
        if name in stored:
            return stored[name].T.contiguous() if transposed else stored[name]
    raise CheckpointError(f"{path}: holds none of {', '.join(repr(name) for name, _ in names)} "
                          f"(it holds {', '.join(map(repr, sorted(stored)))})")


def _optional(stored: Mapping[str, Tensor], names: tuple[str, ...]) -> Optional[Tensor]:
    return next((stored[name] for name in names if name in stored), None)


SPARSIFY = ForeignKind("sparsify", _files, _convert)
