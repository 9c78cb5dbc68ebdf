"""Models across devices through ``accelerate``: blocks on GPUs and the CPU, offloaded to disk.

``load_model(..., device_map=...)`` comes here once a loader has read and checked every tensor.
The model is built without memory (``accelerate.init_empty_weights``), each tensor goes straight to
the device its module is mapped to (or into ``offload_folder`` for "disk"), and
``accelerate.dispatch_model`` adds the hooks that move activations between devices and read an
offloaded block from disk for its forward pass only.

A map's units are the model's top-level modules (``embed``, ``pos_embed``, ``ln_embed``,
``ln_final``, ``unembed``) and whole blocks (``blocks.3``), so each block's hook points and KV cache
live on one device. The top-level modules are never offloaded to disk: experiments read their
weights directly (the unembedding for logit differences, the final norm for the lens), and they are
a small part of a large model. Blocks mapped to "cpu" run on the CPU; blocks on "disk" are read into
memory for their forward and run on the CPU.

``plan`` answers the same question before anything is loaded: the weights' and a cache's bytes per
device, from a model built on the meta device.
"""

from __future__ import annotations

import json
import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import pandas as pd
import torch
from torch import Tensor

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.extras import require
from workbench.loading.weights import assign_weights, check_weights
from workbench.memory import readable_bytes
from workbench.model import Decoder
from workbench.tokenizer import Tokenizer

DeviceMapSpec = Union[str, Mapping[str, Union[int, str, torch.device]]]
MaxMemory = Optional[Mapping[Union[int, str], Union[int, str]]]
AUTO_MAPS = ("auto", "sequential")
OFFLOAD_INDEX = "index.json"
FEATURE = "device maps and offloading"


@dataclass(frozen=True)
class Placement:
    """Where ``load_model`` puts the weights: a device map ("auto", "sequential" or {unit: device}),
    the memory each device may use, and the folder for blocks offloaded to disk.

    Example:
        >>> Placement({"embed": "cpu", "blocks": "cpu"}).device_map["blocks"]
        'cpu'
    """

    device_map: DeviceMapSpec
    max_memory: MaxMemory = None
    offload_folder: Optional[Union[str, Path]] = None


def units(model: Decoder) -> list[str]:
    """The modules a device map assigns, in forward order: top-level modules with weights, then each block.

    Example:
        >>> units(wb.Decoder(wb.ModelConfig(n_layers=2, d_model=8, n_heads=2, d_vocab=10, n_ctx=4)))   # doctest: +SKIP
        ['embed', 'pos_embed', 'ln_final', 'unembed', 'blocks.0', 'blocks.1']
    """
    top = [name for name, module in model.named_children()
           if name != "blocks" and next(module.parameters(), None) is not None]
    return top + [f"blocks.{layer}" for layer in range(len(model.blocks))]


def unit_of(name: str) -> str:
    """The unit a parameter or hook point belongs to (``blocks.3.attn.W_Q`` -> ``blocks.3``,
    ``hook_embed`` -> ``embed``, ``ln_final.hook_scale`` -> ``ln_final``).

    Example:
        >>> unit_of("blocks.3.attn._W_Q_lin"), unit_of("hook_pos_embed"), unit_of("unembed.b_U")
        ('blocks.3', 'pos_embed', 'unembed')
    """
    parts = name.split(".")
    if parts[0] == "blocks":
        return ".".join(parts[:2])
    return parts[0].removeprefix("hook_") if len(parts) == 1 else parts[0]


def device_label(device: Union[int, str, torch.device]) -> str:
    """A device as this module names it: "cuda:N", "cpu", "disk" (accelerate's int N is "cuda:N").

    Example:
        >>> device_label(0), device_label("cuda"), device_label(torch.device("cpu")), device_label("disk")
        ('cuda:0', 'cuda:0', 'cpu', 'disk')
    """
    if isinstance(device, bool):
        raise ConfigError(f"device_map: {device!r} is not a device")
    if isinstance(device, int):
        return f"cuda:{device}"
    if device == "disk":
        return "disk"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"device_map: {device!r} is not a device (use 'cuda:N', N, 'cpu' or 'disk')") from error
    if parsed.type == "cuda":
        return f"cuda:{parsed.index or 0}"
    if parsed.type != "cpu":
        raise ConfigError(f"device_map: device {device!r} is not supported (use 'cuda:N', N, 'cpu' or 'disk')")
    return "cpu"


def _accelerate_device(label: str) -> Union[int, str]:
    return int(label.split(":")[1]) if label.startswith("cuda:") else label


def _check_devices_exist(device_map: Mapping[str, str]) -> None:
    for unit, label in device_map.items():
        index = _accelerate_device(label)
        if isinstance(index, int) and index >= torch.cuda.device_count():
            raise ConfigError(f"device_map['{unit}'] = '{label}', but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")


def empty_model(cfg: ModelConfig, tokenizer: Optional[Tokenizer] = None, **options: Any) -> Decoder:
    """A ``Decoder`` whose parameters are on the meta device (no memory), tied as in a real one, and
    whose tables (RoPE, ALiBi, sinusoidal) are real CPU buffers: parameter shapes and placement
    without the weights.

    Example:
        >>> empty_model(cfg).embed.W_E.device   # doctest: +SKIP
        device(type='meta')
    """
    with torch.device("meta"):
        return Decoder(cfg, tokenizer=tokenizer, init_weights=False, **options)


def unit_bytes(model: Decoder) -> dict[str, int]:
    """Bytes of each unit's parameters (a parameter two units share counts once, in the first).

    Example:
        >>> unit_bytes(model)["blocks.0"]   # doctest: +SKIP
        13271040
    """
    out = {unit: 0 for unit in units(model)}
    for name, param in model.named_parameters():  # named_parameters lists a shared one once
        out[unit_of(name)] += param.numel() * param.element_size()
    return out


def resolve_device_map(model: Decoder, placement: Placement) -> dict[str, str]:
    """{unit: "cuda:N" | "cpu" | "disk"} for every unit of ``model``, from ``placement``.

    "auto" and "sequential" fill the GPUs in order, then the CPU, then disk, within ``max_memory``
    (default: each device's free memory); "auto" first balances the blocks over several GPUs. The
    top-level modules go on the first device. A dict maps units or their prefixes ("blocks" for
    every block); every unit must be covered. ``ConfigError`` names whatever does not fit.

    Example:
        >>> resolve_device_map(model, Placement({"embed": "cpu", "unembed": "cpu", "ln_final": "cpu",
        ...                                      "blocks.0": "cpu", "blocks.1": "disk"}))   # doctest: +SKIP
        {'embed': 'cpu', 'ln_final': 'cpu', 'unembed': 'cpu', 'blocks.0': 'cpu', 'blocks.1': 'disk'}
    """
    spec = placement.device_map
    if isinstance(spec, str):
        if spec not in AUTO_MAPS:
            raise ConfigError(f"device_map={spec!r}: use 'auto', 'sequential' or a dict {{module: device}}")
        device_map = _fill(model, placement.max_memory, balanced=spec == "auto")
    elif isinstance(spec, Mapping):
        if placement.max_memory is not None:
            raise ConfigError("max_memory only applies to device_map='auto' or 'sequential'; "
                              "a dict already says where each module goes")
        device_map = _expand(model, spec)
    else:
        raise ConfigError(f"device_map must be 'auto', 'sequential' or a dict {{module: device}}, got {spec!r}")
    top_on_disk = [unit for unit, device in device_map.items() if device == "disk" and not unit.startswith("blocks.")]
    if top_on_disk:
        raise ConfigError(f"device_map puts {top_on_disk} on 'disk': only blocks can be offloaded to disk "
                          "(experiments read the embedding, final norm and unembedding directly)")
    _check_devices_exist(device_map)
    return device_map


def _expand(model: Decoder, spec: Mapping) -> dict[str, str]:
    """A user's {prefix: device} as {unit: device}: the longest key that is the unit or a prefix of it."""
    all_units = units(model)
    for key in spec:
        if not isinstance(key, str) or not any(unit == key or unit.startswith(key + ".") for unit in all_units):
            finer = isinstance(key, str) and any(key.startswith(unit + ".") for unit in all_units)
            raise ConfigError(f"device_map key {key!r} " + (
                "is part of a block: map whole blocks ('blocks.3') or top-level modules" if finer else
                f"is not a module of this model (units: {', '.join(all_units[:6])} ... {all_units[-1]}, or 'blocks')"))
    out = {}
    for unit in all_units:
        keys = [key for key in spec if unit == key or unit.startswith(key + ".")]
        if not keys:
            raise ConfigError(f"device_map does not say where '{unit}' goes; give every block and top-level "
                              "module a device (e.g. 'blocks': 'cpu' for all blocks)")
        out[unit] = device_label(spec[max(keys, key=len)])
    return out


def _budgets(max_memory: MaxMemory) -> dict[str, int]:
    """{device label: bytes} for GPUs then the CPU: ``max_memory`` (ints or "10GiB" strings, GPU keys as
    N or "cuda:N") or, without it, each device's free memory now."""
    from accelerate.utils import get_max_memory

    if max_memory is None:
        found = get_max_memory(None)
    else:
        normalised = {}
        for key, value in max_memory.items():
            label = device_label(key)
            if label != "disk":  # disk has no budget: whatever does not fit goes there
                normalised[_accelerate_device(label)] = value
        try:
            found = get_max_memory(normalised)
        except ValueError as error:
            raise ConfigError(f"max_memory={dict(max_memory)!r}: {error}") from error
    return {device_label(device): int(size) for device, size in found.items()}


def _fill(model: Decoder, max_memory: MaxMemory, balanced: bool) -> dict[str, str]:
    """The greedy map: top-level modules on the first device, then blocks in order on each device while
    they fit, the rest on disk (keeping room on the CPU for the largest block, read there to run)."""
    sizes = unit_bytes(model)
    budgets = _budgets(max_memory)
    gpus = [label for label in budgets if label.startswith("cuda:")]
    if balanced and len(gpus) > 1:  # spread the blocks evenly over the GPUs instead of filling the first
        blocks_total = sum(size for unit, size in sizes.items() if unit.startswith("blocks."))
        share = math.ceil(blocks_total / len(gpus) * 1.05)
        budgets = {label: min(size, share) if label in gpus[:-1] else size for label, size in budgets.items()}
    devices = list(budgets)
    if not devices:
        raise ConfigError(f"max_memory={max_memory!r} leaves no device to load onto")
    top = [unit for unit in sizes if not unit.startswith("blocks.")]
    blocks = [unit for unit in sizes if unit.startswith("blocks.")]
    free = dict(budgets)
    first = devices[0]
    top_bytes = sum(sizes[unit] for unit in top)
    if top_bytes > free[first]:
        raise ConfigError(f"the embedding, final norm and unembedding need {readable_bytes(top_bytes)} on {first}, "
                          f"but max_memory allows {readable_bytes(free[first])} there; they cannot go to disk")
    free[first] -= top_bytes
    if sum(sizes[unit] for unit in blocks) > sum(free.values()) and "cpu" in free:
        free["cpu"] -= max(sizes[unit] for unit in blocks)  # an offloaded block is read into RAM to run
    device_map = dict.fromkeys(top, first)
    position = 0
    for unit in blocks:
        while position < len(devices) and sizes[unit] > free[devices[position]]:
            position += 1
        device = devices[position] if position < len(devices) else "disk"
        if device != "disk":
            free[device] -= sizes[unit]
        device_map[unit] = device
    return device_map


def _prepare_offload_folder(folder: Optional[Union[str, Path]], device_map: Mapping[str, str]) -> Optional[Path]:
    """The offload folder, empty and ready (a previous offload there is cleared), or None without disk units."""
    on_disk = [unit for unit, device in device_map.items() if device == "disk"]
    if not on_disk:
        return None
    if folder is None:
        raise ConfigError(f"the device map puts {on_disk[0]}{' ...' if len(on_disk) > 1 else ''} on 'disk' "
                          f"({len(on_disk)} block(s)): pass offload_folder= for their weights")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"offload_folder {folder}: exists and is not a directory")
    if folder.is_dir() and any(folder.iterdir()):
        if not (folder / OFFLOAD_INDEX).is_file():
            raise ConfigError(f"offload_folder {folder}: not empty and not an earlier offload (no {OFFLOAD_INDEX}); "
                              "use an empty or new directory")
        _clear_offload(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _clear_offload(folder: Path, names=None) -> None:
    """Removes an offload's files, nothing else: the weights ``names`` lists (default: those its index
    lists) and the index."""
    if names is None:
        try:
            names = json.loads((folder / OFFLOAD_INDEX).read_text())
        except (OSError, json.JSONDecodeError):
            names = {}
    for name in names:
        (folder / f"{name}.dat").unlink(missing_ok=True)
    (folder / OFFLOAD_INDEX).unlink(missing_ok=True)


def build_model(cfg: ModelConfig, tokenizer: Optional[Tokenizer], tensors: dict[str, Tensor], source: str,
                device: str = "cpu", placement: Optional[Placement] = None, **options: Any) -> Decoder:
    """Every loader's last step: the model holding ``tensors`` (read and converted by the loader), on
    ``device``, or placed across devices by ``placement``; in eval mode. ``options``: its ``RuntimeOptions``
    (``dtype``, ``attn_impl``, a saved model's ``weight_processing`` ...).

    Example:
        >>> model = build_model(cfg, tokenizer, tensors, "ckpt/model.safetensors", device="cpu")   # doctest: +SKIP
    """
    if placement is not None:
        return build_dispatched(cfg, tokenizer, tensors, source, placement, **options)
    model = Decoder(cfg, tokenizer=tokenizer, init_weights=False, **options)
    assign_weights(model, tensors, source, move=True)
    return model.to(device).eval()


def build_dispatched(cfg: ModelConfig, tokenizer: Optional[Tokenizer], tensors: dict[str, Tensor], source: str,
                     placement: Placement, **options: Any) -> Decoder:
    """A ``Decoder`` holding ``tensors`` placed by ``placement`` and dispatched by accelerate.

    Each tensor goes from the loader straight to its unit's device (cast to ``options['dtype']``) or into the
    offload folder; the model's ``device_map`` attribute records the map and ``cfg.device`` is the
    embedding's device (where tokens go). On any error the files written so far are removed.

    Example:
        >>> model = build_dispatched(cfg, tokenizer, tensors, "ckpt", Placement("auto"))   # doctest: +SKIP
    """
    require("accelerate", FEATURE)
    from accelerate import dispatch_model
    from accelerate.utils import find_tied_parameters, offload_weight, retie_parameters, set_module_tensor_to_device

    model = empty_model(cfg, tokenizer, **options)
    check_weights(model, tensors, source)
    device_map = resolve_device_map(model, placement)
    folder = _prepare_offload_folder(placement.offload_folder, device_map)
    ties = find_tied_parameters(model)
    first = units(model)[0]  # where tokens enter
    index: dict = {}
    try:
        for name in list(tensors):
            value = tensors.pop(name).to(model.options.dtype)  # dropped from the loader's dict as it is placed
            device = device_map[unit_of(name)]
            if device == "disk":
                offload_weight(value, name, str(folder), index)
            else:
                set_module_tensor_to_device(model, name, _accelerate_device(device), value=value)
        retie_parameters(model, ties)
        if index:
            (folder / OFFLOAD_INDEX).write_text(json.dumps(index, indent=1))
        main_device = "cpu" if "cpu" in device_map.values() or "disk" in device_map.values() else \
            _accelerate_device(device_map[first])
        with _quiet_accelerate():
            dispatch_model(model, {unit: _accelerate_device(device) for unit, device in device_map.items()},
                           main_device=main_device, offload_dir=str(folder) if folder else None,
                           preload_module_classes=["TransformerBlock"], force_hooks=True)
    except BaseException:
        if folder is not None:
            _clear_offload(folder, index)  # what this load wrote, index file or not
        raise
    model.options.device = device_map[first]
    model.device_map = device_map
    return model.eval()


@contextmanager
def _quiet_accelerate():
    """Silences dispatch_model's warning that offloaded parameters sit on the meta device (expected here;
    ``model.device_map`` says where each block is)."""
    logger = logging.getLogger("accelerate.big_modeling")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def plan(cfg: ModelConfig, placement: Placement, batch: int = 1, pos: int = 1024,
         names_filter=None, dtype: torch.dtype = torch.float32) -> pd.DataFrame:
    """Per device: the units placed there, their weights' bytes, and the bytes ``run_with_cache`` of
    ``batch`` x ``pos`` tokens caches there (every hook, or ``names_filter``'s; each hook's activation
    stays on its block's device). Nothing is loaded: the shapes come from a forward pass on the meta device.

    Example:
        >>> plan(cfg, Placement("auto", max_memory={"cpu": "200MiB"}), batch=8, pos=128)   # doctest: +SKIP
    """
    model = empty_model(cfg, dtype=dtype)
    device_map = resolve_device_map(model, placement)
    sizes = unit_bytes(model)
    cache = _cache_bytes_per_unit(model, batch, min(pos, cfg.n_ctx), names_filter)
    rows = []
    for device in dict.fromkeys(device_map.values()):
        placed = [unit for unit, where in device_map.items() if where == device]
        cache_device = "cpu" if device == "disk" else device  # an offloaded block runs on the CPU
        rows.append({"device": device, "units": _describe(placed), "weights_bytes": sum(sizes[u] for u in placed),
                     "cache_bytes": sum(cache.get(u, 0) for u in placed), "cache_on": cache_device})
    table = pd.DataFrame(rows)
    table["weights"] = table["weights_bytes"].map(readable_bytes)
    table["cache"] = table["cache_bytes"].map(readable_bytes)
    table.attrs.update(dtype=str(dtype).removeprefix("torch."), batch=batch, pos=min(pos, cfg.n_ctx))
    return table


def _describe(placed: list[str]) -> str:
    """'embed, unembed, blocks.0-11' for a list of units."""
    top = [unit for unit in placed if not unit.startswith("blocks.")]
    layers = [int(unit.split(".")[1]) for unit in placed if unit.startswith("blocks.")]
    runs, start = [], None
    for index, layer in enumerate(layers):
        if start is None:
            start = layer
        if index + 1 == len(layers) or layers[index + 1] != layer + 1:
            runs.append(f"blocks.{start}" if start == layer else f"blocks.{start}-{layer}")
            start = None
    return ", ".join(top + runs)


@torch.no_grad()
def _cache_bytes_per_unit(model: Decoder, batch: int, pos: int, names_filter) -> dict[str, int]:
    """Bytes each unit's hooks would cache for [batch, pos] tokens, from a forward pass on the meta device."""
    model = model.to("meta")
    _, caching_hooks, _ = model.get_caching_hooks(names_filter)
    wanted = {name for name, _ in caching_hooks}
    found: dict[str, int] = {}

    def record(tensor: Tensor, hook) -> None:
        found[hook.name] = tensor.numel() * tensor.element_size()

    resid_BPD = torch.empty(batch, pos, model.cfg.d_model, device="meta", dtype=model.cfg.dtype)
    with model.hooks(fwd_hooks=[(name, record) for name in wanted]):
        for name in ("hook_embed", "hook_pos_embed"):  # before the first block: the run starts at layer 0
            if name in wanted:
                model.hook_dict[name](resid_BPD)
        model(resid_BPD, start_at_layer=0, return_type=None)
    out: dict[str, int] = {}
    for name, n_bytes in found.items():
        out[unit_of(name)] = out.get(unit_of(name), 0) + n_bytes
    return out

