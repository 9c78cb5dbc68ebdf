"""``load_transcoders``: a ``TranscoderSet`` from circuit-tracer's formats, SAELens transcoders or our own directory.

- circuit-tracer per-layer sets: ``config.yaml`` with ``model_kind: transcoder_set``, ``feature_input_hook``,
  ``feature_output_hook``, ``scan`` and ``transcoders`` (one ``layer_{i}.safetensors`` path per layer, absolute or
  relative to the YAML; without the list, the YAML's folder's ``layer_{i}.safetensors``). Each file holds
  ``W_enc [F, D]``, ``W_dec [F, D]``, ``b_enc``, ``b_dec``, optional ``activation_function.threshold`` (JumpReLU)
  and ``W_skip [D, D]`` (applied as ``x @ W_skip.T``).
- circuit-tracer cross-layer transcoders: ``config.yaml`` with ``model_kind: cross_layer_transcoder`` beside
  ``W_enc_{i}.safetensors`` (``W_enc_i``, ``b_enc_i``, ``b_dec_i``, optional ``threshold_i``) and
  ``W_dec_{i}.safetensors`` (``W_dec_i [F, n_layers - i, D]``).
- SAELens transcoders (``wb.load_sae``): a list of their directories, or a folder of them, one per layer.
- Ours: ``transcoders.json`` + ``transcoders.safetensors`` (``TranscoderSet.save``).
- From the Hub (``workbench.hub.transcoder_sources``, imported when asked for): circuit-tracer's presets
  (``"gemma"``, ``"llama"``), ``org/repo[/folder][@revision]`` holding a ``config.yaml``, and ``hf://`` entries of
  any ``config.yaml``; only the files the config names are fetched. A layer file ending ``.npz`` is Gemma Scope's
  ``params.npz`` (``W_enc [D, F]``, ``W_dec``, ``b_enc``, ``b_dec``, ``threshold``), as circuit-tracer reads it.

A relative path that resolves outside the YAML's folder is refused; every tensor is checked before anything is
built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from safetensors import SafetensorError, safe_open

from workbench.devices import check_device
from workbench.errors import CheckpointError, ConfigError, InputError
from workbench.safe_files import inside
from workbench.sae.files import load_sae
from workbench.shipped import shipped_folder
from workbench.transcoders.format import FORMAT_NAME, OUR_CONFIG, OUR_WEIGHTS
from workbench.transcoders.hooks import split_block_hook
from workbench.transcoders.set import TranscoderSet
from workbench.transcoders.yaml_config import read_config

PathLike = Union[str, Path]
KINDS = ("transcoder_set", "cross_layer_transcoder")


def load_transcoders(path: Union[PathLike, Sequence[PathLike]], device: Any = "cpu",
                     dtype: Any = torch.float32) -> TranscoderSet:
    """The transcoders at ``path`` (a circuit-tracer ``config.yaml`` or its folder, a folder written by
    ``TranscoderSet.save``, a folder of SAELens transcoder directories, a list of those directories, or the name of
    a shipped transcoder set, ``wb.shipped(kind="transcoders")``), on
    ``device`` in ``dtype``. Bad files are a ``CheckpointError`` naming the file and tensor, bad config values a
    ``ConfigError`` naming the field.

    On the Hub (when no local path has that name): circuit-tracer's presets ``"gemma"`` and ``"llama"``, a repo
    reference ``"org/repo[/folder][@revision]"`` whose folder holds circuit-tracer's ``config.yaml``, or an
    ``"hf://org/repo[/folder][?revision=...]"`` address; a local ``config.yaml`` may name ``hf://`` files too. What
    the config names is fetched into the standard HF cache (``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, ``HF_TOKEN`` read at
    the call), and nothing else.

    Example:
        >>> wb.load_transcoders("/no/such/transcoders")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: /no/such/transcoders: no such file or directory (transcoders are a circuit-tracer config.yaml or its folder, a folder written by TranscoderSet.save, or SAELens transcoder directories)
        >>> wb.load_transcoders("gemma")   # the suite runs offline, with nothing cached
        Traceback (most recent call last):
        workbench.hub.errors.HubNotFoundError: gemma: no such file or directory, and as transcoders on the Hub: mwhanna/gemma-scope-transcoders (revision 'main'): the Hub is switched off (HF_HUB_OFFLINE=1), ...
    """
    check_device(device)
    if isinstance(path, (list, tuple)):
        if not path:
            raise InputError("load_transcoders got an empty list: give one SAELens transcoder directory per layer, "
                             "a folder of them, a circuit-tracer config.yaml or a folder written by TranscoderSet.save")
        if not all(isinstance(p, (str, Path)) for p in path):
            raise InputError(f"load_transcoders takes paths, got {[type(p).__name__ for p in path]}")
        tcs = _from_saelens([Path(p) for p in path])
    elif not isinstance(path, (str, Path)):
        raise InputError(f"load_transcoders takes a path or a list of paths, got {type(path).__name__}")
    else:
        folder = Path(path)
        if not folder.exists() and (shipped := shipped_folder(path, "transcoders")) is not None:
            folder = shipped  # a name from wb.shipped(kind="transcoders")
        if not folder.exists() and _names_hub_transcoders(str(path)):
            tcs = _from_hub(str(path))
        else:
            tcs = _from_path(folder, str(path))
    return tcs.to(device=device, dtype=dtype)


def _from_path(path: Path, shown: str) -> TranscoderSet:
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        return _from_circuit_tracer(path)
    if path.is_dir():
        if (path / "config.yaml").is_file():
            return _from_circuit_tracer(path / "config.yaml")
        if (path / OUR_CONFIG).is_file():
            return _from_ours(path)
        subfolders = sorted((p for p in path.iterdir() if (p / "cfg.json").is_file()), key=lambda p: p.name)
        if subfolders:
            return _from_saelens(subfolders)
        if (path / "cfg.json").is_file():
            return _from_saelens([path])
    raise CheckpointError(f"{shown}: no such file or directory (transcoders are a circuit-tracer config.yaml or its "
                          "folder, a folder written by TranscoderSet.save, or SAELens transcoder directories)"
                          if not path.exists() else
                          f"{shown}: not a transcoder set (no config.yaml, {OUR_CONFIG} or SAELens cfg.json found)")


# ---- the Hub ---------------------------------------------------------------------------------------------------
def _names_hub_transcoders(source: str) -> bool:
    from workbench.hub.transcoder_sources import is_transcoder_reference  # huggingface_hub only when asked for

    return is_transcoder_reference(source)


def _from_hub(source: str) -> TranscoderSet:
    """circuit-tracer's ``load_transcoder_from_hub``: the config fetched, then what it names; ``scan`` as it sets it."""
    from workbench.hub.errors import HubNotFoundError
    from workbench.hub.transcoder_sources import fetch_transcoder_config

    try:
        hub = fetch_transcoder_config(source)
    except HubNotFoundError as error:
        if not error.whole_repo:
            raise
        raise HubNotFoundError(f"{source}: no such file or directory, and as transcoders on the Hub: {error}",
                               whole_repo=True) from error
    return _from_circuit_tracer(hub.config_path, hub)


# ---- circuit-tracer --------------------------------------------------------------------------------------------
def _from_circuit_tracer(config_path: Path, hub: Any = None) -> TranscoderSet:
    """A circuit-tracer set from its ``config.yaml``; ``hub`` (a ``HubTranscoders``) when the config came from the
    Hub: its entries name files of that repo, fetched, and ``scan`` is where it came from."""
    shown = hub.shown if hub is not None else config_path
    config = read_config(config_path)
    if not isinstance(config, dict):
        raise ConfigError(f"{shown}: must be a mapping of fields, got {type(config).__name__}")
    kind = config.get("model_kind")
    if kind not in KINDS:
        raise ConfigError(f"{shown}: field 'model_kind' must be one of {KINDS}, got {kind!r}")
    hooks = {field: _string_field(config, field, shown) for field in ("feature_input_hook", "feature_output_hook")}
    scan = config.get("scan") if hub is None else hub.where.scan
    try:
        if kind == "transcoder_set":
            return _per_layer_set(config_path, config, hooks, scan, hub)
        return _cross_layer(config_path.parent if hub is None else hub.cross_layer_folder(), hooks, scan)
    except ConfigError as error:
        raise ConfigError(f"{shown}: {error}") from None


def _string_field(config: dict, field: str, config_path: Any) -> str:
    value = config.get(field)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{config_path}: field {field!r} must be a hook name such as 'mlp.hook_in', got {value!r}")
    return value


def _per_layer_set(config_path: Path, config: dict, hooks: dict, scan: Any, hub: Any = None) -> TranscoderSet:
    folder = config_path.parent
    paths = config.get("transcoders")
    if paths is not None and not (isinstance(paths, list) and paths and all(isinstance(p, str) for p in paths)):
        raise ConfigError(f"field 'transcoders' must be a non-empty list of file paths, got {paths!r}")
    if hub is not None:
        files = hub.layer_files(paths)
    elif paths is None:
        files = [inside(folder, f"layer_{i}.safetensors", what="transcoder folder")
                 for i in range(len(list(folder.glob("layer_*.safetensors"))))]
    else:
        local = {i: p for i, p in enumerate(paths) if not p.startswith("hf://")}
        if len(local) > len(list(folder.iterdir())):
            raise ConfigError(f"field 'transcoders' lists {len(local)} files, more than the "
                              f"{len(list(folder.iterdir()))} entries of the config's folder (every local layer file "
                              "lies inside it)")
        files_of = {i: _layer_file(folder, p, i) for i, p in local.items()}  # all checked before any download
        if len(local) < len(paths):
            from workbench.hub.transcoder_sources import fetch_addresses  # huggingface_hub only when asked for

            remote = [p for p in paths if p.startswith("hf://")]
            fetched = fetch_addresses(remote)
            files_of.update({i: fetched[p] for i, p in enumerate(paths) if i not in local})
        files = [files_of[i] for i in range(len(paths))]
    if not files:
        raise CheckpointError(f"{folder}: no layer_{{i}}.safetensors files and no 'transcoders' list in config.yaml")
    layers = [_read_per_layer(file) for file in files]
    skips = {layer["W_skip"] is not None for layer in layers}
    if len(skips) > 1:
        raise CheckpointError(f"{folder}: some layers have W_skip and some do not; a set is all one or the other")
    return _build(str(folder), W_enc=[t["W_enc"] for t in layers], b_enc=[t["b_enc"] for t in layers],
                  threshold=[t["threshold"] for t in layers], W_dec=[t["W_dec"][:, None] for t in layers],
                  b_dec=_stack([t["b_dec"] for t in layers], folder, "b_dec"),
                  W_skip=[t["W_skip"] for t in layers] if skips == {True} else None,
                  feature_input_hook=hooks["feature_input_hook"], feature_output_hook=hooks["feature_output_hook"],
                  scan=scan)


def _layer_file(folder: Path, given: str, layer: int) -> Path:
    """The file ``given`` names, inside ``folder`` (an absolute path only when it lies inside the folder)."""
    if "://" in given:
        raise ConfigError(f"field 'transcoders'[{layer}] is {given!r}: the one address scheme read is hf://")
    relative = Path(given)
    if relative.is_absolute() and Path(given).resolve().is_relative_to(folder.resolve()):
        relative = Path(given).resolve().relative_to(folder.resolve())
    try:
        candidate = inside(folder, relative, what="transcoder folder")
    except CheckpointError:
        raise ConfigError(f"field 'transcoders'[{layer}] is {given!r}, which resolves outside the config's folder "
                          f"({(folder / given).resolve()}); refusing to read it") from None
    if not candidate.is_file():
        raise CheckpointError(f"{candidate}: missing (field 'transcoders'[{layer}] of the config)")
    return candidate


def _read_file(path: Path, allowed: Optional[set[str]] = None) -> dict[str, torch.Tensor]:
    """The file's tensors; with ``allowed``, an unexpected name is refused from the header, before any is read."""
    try:
        with safe_open(str(path), framework="pt") as file:
            extra = sorted(set(file.keys()) - allowed) if allowed is not None else []
            if extra:
                raise CheckpointError(f"{path}: unexpected tensor {', '.join(map(repr, extra))}")
            return {name: file.get_tensor(name) for name in file.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None


def _tensor_names(path: Path) -> list[str]:
    """The names a safetensors file declares (its header only)."""
    try:
        with safe_open(str(path), framework="pt") as file:
            return list(file.keys())
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None


def _read_gemma_scope(path: Path) -> dict[str, torch.Tensor]:
    """Gemma Scope's ``params.npz`` in circuit-tracer's names (its ``load_gemma_scope_transcoder``): ``W_enc`` is
    stored ``[D, F]`` and transposed, ``threshold`` is the JumpReLU's; nothing else may be in the file."""
    from workbench.sae.foreign.kinds import read_npz  # the checked .npz reader (no pickles)

    tensors = read_npz(path)
    extra = sorted(set(tensors) - {"W_enc", "W_dec", "b_enc", "b_dec", "threshold"})
    if extra:
        raise CheckpointError(f"{path}: unexpected array {', '.join(map(repr, extra))} (Gemma Scope's params.npz "
                              "holds W_enc, W_dec, b_enc, b_dec and threshold)")
    if "W_enc" in tensors and tensors["W_enc"].dim() == 2:
        tensors["W_enc"] = tensors["W_enc"].T
    if "threshold" in tensors:
        tensors["activation_function.threshold"] = tensors.pop("threshold")
    return tensors


def _read_per_layer(path: Path) -> dict[str, Optional[torch.Tensor]]:
    required = ("W_enc", "W_dec", "b_enc", "b_dec")
    optional = {"activation_function.threshold": "threshold", "W_skip": "W_skip"}
    try:
        tensors = _read_gemma_scope(path) if path.suffix == ".npz" else _read_file(path, set(required) | set(optional))
    except CheckpointError as error:
        if "unexpected tensor" not in str(error):
            raise
        raise CheckpointError(f"{error} (a circuit-tracer layer file holds W_enc, W_dec, b_enc, b_dec, optional "
                              "activation_function.threshold and W_skip)") from None
    missing = [name for name in required if name not in tensors]
    if missing:
        raise CheckpointError(f"{path}: missing tensor {', '.join(map(repr, missing))} (a circuit-tracer layer file "
                              "holds W_enc, W_dec, b_enc, b_dec, optional activation_function.threshold and W_skip)")
    out: dict[str, Optional[torch.Tensor]] = {name: _float(tensors[name], path, name) for name in required}
    for stored, ours in optional.items():
        out[ours] = _float(tensors[stored], path, stored) if stored in tensors else None
    _non_negative(out["threshold"], path, "activation_function.threshold")
    return out


def _non_negative(threshold: Optional[torch.Tensor], path: Path, name: str) -> None:
    """circuit-tracer's JumpReLU ``x * (x > threshold)`` is SAELens's ``relu(x) * (x > threshold)``, the one we
    compute, only for a threshold of at least zero."""
    if threshold is not None and bool((threshold < 0).any()):
        raise CheckpointError(f"{path}: tensor {name!r} has negative entries; circuit-tracer's JumpReLU would pass "
                              "negative activations there, which SAELens's rule (ours) does not")


def _cross_layer(folder: Path, hooks: dict, scan: Any) -> TranscoderSet:
    n_layers = len(list(folder.glob("W_enc_*.safetensors")))
    if n_layers == 0:
        raise CheckpointError(f"{folder}: a cross-layer transcoder needs W_enc_{{i}}.safetensors files beside config.yaml")
    enc, dec = [], []
    for layer in range(n_layers):
        enc_path, dec_path = folder / f"W_enc_{layer}.safetensors", folder / f"W_dec_{layer}.safetensors"
        for file in (enc_path, dec_path):
            if not file.is_file():
                raise CheckpointError(f"{file}: missing (a cross-layer transcoder of {n_layers} layers needs "
                                      f"W_enc_0..{n_layers - 1} and W_dec_0..{n_layers - 1})")
        tensors = _read_file(enc_path, {f"{key}_{layer}" for key in ("W_enc", "b_enc", "b_dec", "threshold")})
        for name in (f"W_enc_{layer}", f"b_enc_{layer}", f"b_dec_{layer}"):
            if name not in tensors:
                raise CheckpointError(f"{enc_path}: missing tensor {name!r}")
        enc.append({key: _float(tensors[f"{key}_{layer}"], enc_path, f"{key}_{layer}") if f"{key}_{layer}" in tensors
                    else None for key in ("W_enc", "b_enc", "b_dec", "threshold")})
        _non_negative(enc[-1]["threshold"], enc_path, f"threshold_{layer}")
        dec_tensors = _read_file(dec_path, {f"W_dec_{layer}"})
        if f"W_dec_{layer}" not in dec_tensors:
            raise CheckpointError(f"{dec_path}: missing tensor 'W_dec_{layer}'")
        dec.append(_float(dec_tensors[f"W_dec_{layer}"], dec_path, f"W_dec_{layer}"))
    if len({t["threshold"] is None for t in enc}) > 1:
        raise CheckpointError(f"{folder}: some layers have threshold_i and some do not")
    return _build(str(folder), W_enc=[t["W_enc"] for t in enc], b_enc=[t["b_enc"] for t in enc],
                  threshold=[t["threshold"] for t in enc], W_dec=dec, b_dec=_stack([t["b_dec"] for t in enc], folder, "b_dec_i"),
                  feature_input_hook=hooks["feature_input_hook"], feature_output_hook=hooks["feature_output_hook"],
                  scan=scan)


# ---- SAELens and ours ------------------------------------------------------------------------------------------
def _from_saelens(folders: list[Path]) -> TranscoderSet:
    by_layer: dict[int, Any] = {}
    names = set()
    for folder in folders:
        sae = load_sae(folder)
        if not sae.spec.transcoder:
            raise ConfigError(f"{folder}: a {sae.cfg.architecture_name!r} SAE is not a transcoder (its architecture "
                              "must be one of the *transcoder rows)")
        if sae.spec.activation not in ("relu", "jumprelu") or sae.cfg.normalize_activations != "none":
            raise ConfigError(f"{folder}: attribution needs a ReLU or JumpReLU transcoder without input normalisation "
                              f"(architecture {sae.cfg.architecture_name!r}, normalize_activations="
                              f"{sae.cfg.normalize_activations!r})")
        layer, name_in = split_block_hook(sae.cfg.hook_name, f"{folder}: metadata.hook_name")
        layer_out, name_out = split_block_hook(sae.cfg.hook_name_out, f"{folder}: metadata.hook_name_out")
        if layer_out != layer or layer in by_layer:
            raise ConfigError(f"{folder}: reads layer {layer} and writes layer {layer_out}; each layer needs exactly one "
                              "transcoder reading and writing its own block")
        by_layer[layer] = sae
        names.add((name_in, name_out))
    if sorted(by_layer) != list(range(len(by_layer))):
        raise ConfigError(f"SAELens transcoders cover layers {sorted(by_layer)}; a set needs every layer from 0")
    if len(names) > 1:
        raise ConfigError(f"SAELens transcoders read or write different hooks per layer: {sorted(names)}")
    (name_in, name_out) = names.pop()
    try:
        return TranscoderSet(feature_input_hook=name_in, feature_output_hook=name_out,
                             layers=[by_layer[i] for i in range(len(by_layer))])
    except InputError as error:
        raise CheckpointError(f"SAELens transcoders: {error}") from None


def _from_ours(folder: Path) -> TranscoderSet:
    try:
        config = json.loads(inside(folder, OUR_CONFIG, what="transcoder folder").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{folder / OUR_CONFIG}: not a readable JSON file ({error})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT_NAME:
        raise ConfigError(f"{folder / OUR_CONFIG}: field 'format' must be {FORMAT_NAME!r}")
    n = config.get("n_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"{folder / OUR_CONFIG}: field 'n_layers' must be a positive integer, got {n!r}")
    weights = inside(folder, OUR_WEIGHTS, must_exist=True, what="transcoder folder")
    stored = sum(name.startswith("W_enc.") for name in _tensor_names(weights))
    if n != stored:
        raise ConfigError(f"{folder / OUR_CONFIG}: field 'n_layers' is {n}, but {OUR_WEIGHTS} holds {stored} layers")
    allowed = {"b_dec"} | {f"{k}.{i}" for i in range(n) for k in ("W_enc", "b_enc", "W_dec", "threshold", "W_skip")}
    tensors = {name: _float(t, weights, name) for name, t in _read_file(weights, allowed).items()}
    wanted = ["b_dec"] + [f"{k}.{i}" for i in range(n) for k in ("W_enc", "b_enc", "W_dec")]
    missing = [name for name in wanted if name not in tensors]
    if missing:
        raise CheckpointError(f"{weights}: missing tensor {', '.join(map(repr, missing[:5]))}"
                              f"{' and more' if len(missing) > 5 else ''} (n_layers={n} in {OUR_CONFIG})")
    skip = "W_skip.0" in tensors
    return _build(str(folder), W_enc=[tensors[f"W_enc.{i}"] for i in range(n)],
                  b_enc=[tensors[f"b_enc.{i}"] for i in range(n)],
                  threshold=[tensors.get(f"threshold.{i}") for i in range(n)],
                  W_dec=[tensors[f"W_dec.{i}"] for i in range(n)], b_dec=tensors["b_dec"],
                  W_skip=[tensors[f"W_skip.{i}"].T for i in range(n)] if skip else None,   # the file: x @ W_skip.{i}
                  feature_input_hook=config.get("feature_input_hook"),
                  feature_output_hook=config.get("feature_output_hook"), scan=config.get("scan"))


# ---- shared ----------------------------------------------------------------------------------------------------
def _float(tensor: torch.Tensor, path: Path, name: str) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise CheckpointError(f"{path}: tensor {name!r} must be floating point, got {tensor.dtype}")
    return tensor.float()


def _stack(tensors: list[torch.Tensor], where: Path, name: str) -> torch.Tensor:
    if len({tuple(t.shape) for t in tensors}) > 1:
        raise CheckpointError(f"{where}: tensor {name!r} differs in shape between layers "
                              f"({sorted({tuple(t.shape) for t in tensors})})")
    return torch.stack(tensors)


def _build(source: str, **fields: Any) -> TranscoderSet:
    """The set, with a shape or value problem reported as a ``CheckpointError`` naming ``source``."""
    try:
        return TranscoderSet(**fields)
    except InputError as error:
        raise CheckpointError(f"{source}: {error}") from None
