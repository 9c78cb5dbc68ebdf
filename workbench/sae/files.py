"""``load_sae``: an SAE from a SAELens directory (``cfg.json`` and ``sae_weights.safetensors``).

It reads SAELens 6 and earlier configs (``workbench.sae.config``) and checks what the weights file declares (its
safetensors header: names, shapes, dtypes) against the config before reading any tensor, then the values
(``workbench.sae.tensors``), before building anything. Paths stay inside the directory
(``workbench.safe_files.inside``). Writing is ``workbench.sae.format``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError, safe_open

from workbench.devices import check_device
from workbench.errors import CheckpointError, ConfigError, InputError
from workbench.safe_files import inside, read_json
from workbench.sae.config import DTYPES, SAEConfig, config_from_dict
from workbench.sae.format import CFG_FILE, WEIGHTS_FILE
from workbench.sae.model import SAE
from workbench.sae.shipped import shipped_path
from workbench.sae.tensors import check_declared, check_tensors

# A cfg.json is a few kilobytes; a larger one is not an SAE config (and is not read into memory).
MAX_CONFIG_BYTES = 16 * 2**20


def load_sae(path: Union[str, Path], sae_id: Optional[str] = None, device: Any = None, dtype: Any = None, *,
             folder: Optional[str] = None, revision: Optional[str] = None) -> SAE:
    """The SAE saved in SAELens directory ``path`` (or shipped under that name: ``shipped_saes()``), on ``device`` (default CPU, as SAELens's ``load_from_disk``)
    in ``dtype``: by default the config's for a directory (as ``load_from_disk``), float32 for a shipped SAE
    opened by name (as ``from_pretrained`` opens a release: its float16 files keep the repository small). A missing, unreadable, mis-shaped or non-finite file or tensor is a
    ``CheckpointError`` naming it; a config value we cannot honour a ``ConfigError`` naming the field.

    ``load_sae(release, sae_id)`` (a second argument) is SAELens's ``SAE.from_pretrained(release, sae_id)``: the SAE
    of a SAELens release, fetched from the Hub (``workbench.hub.sae_releases``; ``wb.pretrained_saes()`` lists them).

    ``load_sae(repo_id, folder="path", revision=None)`` (``folder=`` given: ``path`` is a Hub repo id, never a local
    directory or a release) is the SAE in that folder of the repo, in SAELens's layout or EleutherAI sparsify's
    (``workbench.hub.sae_folders``); ``folder=""`` is the repo's root.

    Example:
        >>> wb.load_sae("no/such/sae")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: no/such/sae: no such directory (an SAE is a directory with cfg.json and sae_weights.safetensors)
    """
    if device is not None:
        check_device(device)
    if folder is not None:
        if sae_id is not None:
            raise InputError(f"load_sae takes a release's sae_id or a repo's folder=, not both (got {sae_id!r} and "
                             f"folder={folder!r})")
        return _load_repo_folder(str(path), folder, revision, device, dtype)
    if revision is not None:
        raise InputError("load_sae's revision= is for a Hub repo's folder (load_sae(repo_id, folder=..., revision=...))")
    if sae_id is not None:
        return _load_pretrained(str(path), sae_id, device, dtype)
    folder = Path(path)
    if not folder.is_dir() and shipped_path(path) is not None:
        folder = shipped_path(path)
        # float16 matmuls on a CPU are about ten times slower than float32 ones (SmolLM2's shipped SAE over 256
        # corpus windows: 112 s against 10 s), and these are opened by name to be used, not to be re-saved.
        dtype = "float32" if dtype is None else dtype
    if not folder.is_dir():
        raise CheckpointError(f"{path}: no such directory (an SAE is a directory with {CFG_FILE} and {WEIGHTS_FILE})")
    cfg_path = inside(folder, CFG_FILE, must_exist=True, what="SAE directory")
    weights_path = inside(folder, WEIGHTS_FILE, must_exist=True, what="SAE directory")
    return load_sae_files(cfg_path, weights_path, device, dtype)


def load_sae_files(cfg_path: Path, weights_path: Path, device: Any = None, dtype: Any = None,
                   cfg_overrides: Optional[dict[str, Any]] = None) -> SAE:
    """The SAE of one ``cfg.json`` and its ``sae_weights.safetensors`` (paths already checked by the caller), with
    ``cfg_overrides`` laid over the config's top level first, as SAELens's ``get_sae_lens_config_from_disk`` does.

    Example:
        >>> load_sae_files(Path("no/cfg.json"), Path("no/sae_weights.safetensors"))
        Traceback (most recent call last):
        workbench.errors.CheckpointError: no/cfg.json: ...
    """
    raw = read_json(cfg_path, MAX_CONFIG_BYTES, what="an SAE config")
    if cfg_overrides and isinstance(raw, dict):
        raw = {**raw, **cfg_overrides}
    cfg = _config(raw, str(cfg_path), dtype, device)
    tensors = _read_tensors(weights_path, cfg)
    return _built(cfg, tensors, str(weights_path))


def sae_from_parts(raw: dict[str, Any], tensors: dict[str, torch.Tensor], source: str, device: Any = None,
                   dtype: Any = None) -> SAE:
    """The SAE of a SAELens config (a parsed ``cfg.json``) and SAELens-named tensors another format was converted
    to (``workbench.sae.foreign``), with the same checks as a SAELens directory; errors are prefixed by ``source``.

    Example:
        >>> sae_from_parts({"architecture": "standard", "d_in": 2, "d_sae": 3}, {}, "params.npz")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: params.npz: missing 'W_dec', 'W_enc', 'b_dec', 'b_enc' (a standard SAE stores ...
    """
    cfg = _config(raw, source, dtype, device)
    return _built(cfg, tensors, source)


def _config(raw: Any, source: str, dtype: Any, device: Any) -> SAEConfig:
    try:
        return config_from_dict(raw, dtype=_dtype_name(dtype),
                                device=str(torch.device(device)) if device is not None else "cpu")
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def _built(cfg: SAEConfig, tensors: dict[str, torch.Tensor], source: str) -> SAE:
    check_tensors(cfg, tensors, source, CheckpointError)
    return SAE.from_tensors(cfg, {name: tensor.to(cfg.torch_dtype) for name, tensor in tensors.items()})


def _load_pretrained(release: str, sae_id: str, device: Any, dtype: Any) -> SAE:
    """SAELens's ``SAE.from_pretrained`` for a release's SAE: its files from the Hub, the release's overrides laid
    over the config, the Neuronpedia id in the metadata (SAELens keeps it there for pre-6.0 configs; here for
    every config) and a registry ``norm_scaling_factor`` folded in when the config says
    ``expected_average_only_in`` (SAELens's ``fold_activation_norm_scaling_factor``; warned about when absent)."""
    from workbench.hub.sae_releases import fetch_files, fetch_optional, lookup, overrides_of  # when asked for
    from workbench.sae.foreign import foreign_kind

    row, entry = lookup(release, sae_id)
    overrides = overrides_of(row, entry)
    dtype = "float32" if dtype is None else dtype  # SAELens's from_pretrained default, whatever the config says
    if row["conversion"] == "sae_lens":
        cfg_path, weights_path = fetch_files(row["repo_id"], [f"{entry['path']}/{CFG_FILE}",
                                                              f"{entry['path']}/{WEIGHTS_FILE}"])
        sae = load_sae_files(cfg_path, weights_path, device=device, dtype=dtype, cfg_overrides=overrides)
    else:  # another library's layout: its files, converted at the file boundary, then the same checks
        kind = foreign_kind(row["conversion"])  # a kind not loaded is refused before any download
        names = kind.files(entry["path"], row, entry)
        paths = dict(zip(names, fetch_files(row["repo_id"], names)))
        paths.update(fetch_optional(row["repo_id"], kind.optional(entry["path"], row, entry)))
        raw, tensors = kind.convert(paths, row, entry)
        sae = sae_from_parts({**raw, **overrides}, tensors, f"{row['repo_id']}/{entry['path']}", device, dtype)
    if "neuronpedia_id" in overrides:
        sae.cfg.metadata["neuronpedia_id"] = overrides["neuronpedia_id"]
    if sae.cfg.normalize_activations == "expected_average_only_in":
        factor = entry.get("norm_scaling_factor")
        if factor is None:
            warnings.warn(f"norm_scaling_factor not found for {release} and {sae_id}, but normalize_activations is "
                          "'expected_average_only_in'. Skipping normalization folding.", stacklevel=3)
        else:
            with torch.no_grad():
                sae.W_enc.mul_(factor), sae.W_dec.div_(factor), sae.b_dec.div_(factor)
            sae.cfg.normalize_activations = "none"
    return sae


def _load_repo_folder(repo_id: str, folder: str, revision: Optional[str], device: Any, dtype: Any) -> SAE:
    """The SAE of a Hub repo's folder (SAELens's or sparsify's layout), with a local directory's checks."""
    from workbench.hub.sae_folders import fetch_sae_folder  # the Hub only when asked for

    fetched = fetch_sae_folder(repo_id, folder, revision)
    if fetched.layout == "sae_lens":
        return load_sae_files(fetched.cfg_path, fetched.weights_path, device=device, dtype=dtype)
    return sae_from_parts(fetched.raw, fetched.tensors, fetched.source, device, dtype)


def _read_tensors(weights_path: Path, cfg: SAEConfig) -> dict[str, torch.Tensor]:
    """The file's tensors, read only once its header's names, shapes and dtypes match ``cfg`` (so an extra or
    oversized tensor is refused unread), with SAELens's handling of a pre-6.0 ``scaling_factor`` (all ones:
    dropped)."""
    source = str(weights_path)
    try:
        with safe_open(source, framework="pt") as file:
            declared = {name: (tuple(file.get_slice(name).get_shape()), file.get_slice(name).get_dtype())
                        for name in file.keys()}
            scale_declared = declared.pop("scaling_factor", None)
            if scale_declared is not None and scale_declared[0] != (cfg.d_sae,):
                raise CheckpointError(f"{source}: tensor 'scaling_factor' has shape {scale_declared[0]}, expected "
                                      f"[d_sae] = ({cfg.d_sae},)")
            check_declared(cfg, declared, source, CheckpointError)
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except CheckpointError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{weights_path}: not a readable safetensors file ({error})") from None
    scale = tensors.pop("scaling_factor", None)
    if scale is not None and not torch.allclose(scale.float(), torch.ones_like(scale, dtype=torch.float32)):
        raise CheckpointError(f"{weights_path}: tensor 'scaling_factor' is not all ones: a fine-tuning scaling "
                              "factor is not supported (SAELens 6 does not load one either)")
    return tensors


def _dtype_name(dtype: Any) -> Optional[str]:
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"load_sae's dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return name
