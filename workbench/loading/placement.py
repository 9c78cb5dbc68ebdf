"""Where a model's weights go across devices: blocks on GPUs and the CPU, offloaded to disk.

``load_model(..., device_map=...)`` asks here, once a loader has read and checked every tensor,
which device each unit goes to (``resolve_device_map``) and readies the folder for blocks on
"disk" (``prepare_offload_folder``); ``workbench.loading.build`` then builds the model there and
``accelerate.dispatch_model`` adds the hooks that move activations between devices and read an
offloaded block from disk for its forward pass only.

A map's units are the model's top-level modules (``embed``, ``pos_embed``, ``ln_embed``,
``ln_final``, ``unembed``) and whole blocks (``blocks.3``), so each block's hook points and KV cache
live on one device. The top-level modules are never offloaded to disk: experiments read their
weights directly (the unembedding for logit differences, the final norm for the lens), and they are
a small part of a large model. Blocks mapped to "cpu" run on the CPU; blocks on "disk" are read into
memory for their forward and run on the CPU.

Nothing here builds a model or moves a weight: it computes placements from a model's parameter
shapes (a model on the meta device will do). ``workbench.loading.memory_plan`` answers the same
question before anything is loaded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from workbench.cache_store import is_plain_file_name
from workbench.errors import ConfigError
from workbench.memory import readable_bytes
from workbench.model import Decoder

DeviceMapSpec = Union[str, Mapping[str, Union[int, str, torch.device]]]
MaxMemory = Optional[Mapping[Union[int, str], Union[int, str]]]
AUTO_MAPS = ("auto", "sequential")
# its own name: a folder holding another tool's index.json (an activation cache) is not an offload of ours
OFFLOAD_INDEX = "workbench-offload-index.json"


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
        >>> units(model)   # toy-attn-2l: rotary, so no pos_embed
        ['embed', 'ln_final', 'unembed', 'blocks.0', 'blocks.1']
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


def accelerate_device(label: str) -> Union[int, str]:
    """A device label as ``accelerate`` names it: "cuda:N" -> N; "cpu" and "disk" as they are.

    Example:
        >>> accelerate_device("cuda:1"), accelerate_device("cpu"), accelerate_device("disk")
        (1, 'cpu', 'disk')
    """
    return int(label.split(":")[1]) if label.startswith("cuda:") else label


def _check_devices_exist(device_map: Mapping[str, str]) -> None:
    for unit, label in device_map.items():
        index = accelerate_device(label)
        if isinstance(index, int) and index >= torch.cuda.device_count():
            raise ConfigError(f"device_map['{unit}'] = '{label}', but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")


def unit_bytes(model: Decoder) -> dict[str, int]:
    """Bytes of each unit's parameters (a parameter two units share counts once, in the first).

    Example:
        >>> unit_bytes(model)["blocks.0"]   # 4 [128, 128] float32 projections and a LayerNorm's two [128]
        263168
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
        ...                                      "blocks.0": "cpu", "blocks.1": "disk"}))
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
    _check_shared_weights_together(model, device_map)
    top_on_disk = [unit for unit, device in device_map.items() if device == "disk" and not unit.startswith("blocks.")]
    if top_on_disk:
        raise ConfigError(f"device_map puts {top_on_disk} on 'disk': only blocks can be offloaded to disk "
                          "(experiments read the embedding, final norm and unembedding directly)")
    _check_devices_exist(device_map)
    return device_map


def shared_weight_units(model: Decoder) -> list[list[str]]:
    """The groups of units that hold one parameter between them (tied embeddings: ``embed`` and ``unembed``).

    Example:
        >>> shared_weight_units(model)   # toy-attn-2l: its unembedding has its own weight
        []
    """
    holders: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        found = holders.setdefault(id(param), [])
        if unit_of(name) not in found:
            found.append(unit_of(name))
    return [found for found in holders.values() if len(found) > 1]


def _check_shared_weights_together(model: Decoder, device_map: Mapping[str, str]) -> None:
    # A tied weight is one tensor on one device: the unit on the other device would compute with a weight
    # that is not where its input is (accelerate moves a unit's inputs, not the weights it shares).
    for shared in shared_weight_units(model):
        if len({device_map[unit] for unit in shared}) > 1:
            placed = ", ".join(f"'{unit}' on '{device_map[unit]}'" for unit in shared)
            raise ConfigError(f"device_map puts {placed}, but they share one weight (tied embeddings): "
                              "map them to the same device")


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
                normalised[accelerate_device(label)] = value
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


def prepare_offload_folder(folder: Optional[Union[str, Path]], device_map: Mapping[str, str]) -> Optional[Path]:
    """The offload folder, empty and ready (a previous offload there is cleared), or None without disk units.

    Example:
        >>> prepare_offload_folder(None, {"embed": "cpu", "blocks.0": "cpu"}) is None   # nothing goes to disk
        True
        >>> prepare_offload_folder(None, {"embed": "cpu", "blocks.0": "disk"})
        Traceback (most recent call last):
        ...
        workbench.errors.ConfigError: the device map puts blocks.0 on 'disk' (1 block(s)): pass offload_folder= for their weights
    """
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
        clear_offload(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def clear_offload(folder: Path, names=None) -> None:
    """Removes an offload's files, nothing else: the weights ``names`` lists (default: those its index
    lists) and the index. Only regular files directly inside ``folder`` are removed: an entry naming
    another place ("../victim"), a link or a folder is left alone.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / "blocks.1.ln1.w.dat").write_bytes(b"weights"), (folder / "notes.txt").write_text("kept")
        >>> _ = (folder / OFFLOAD_INDEX).write_text('{"blocks.1.ln1.w": {}, "../notes": {}}')
        >>> clear_offload(folder)
        >>> sorted(path.name for path in folder.iterdir())
        ['notes.txt']
    """
    if names is None:
        try:
            names = json.loads((folder / OFFLOAD_INDEX).read_text())
        except (OSError, json.JSONDecodeError):
            names = {}
    if not isinstance(names, (dict, list)):
        names = {}
    for name in names:
        file_name = f"{name}.dat" if isinstance(name, str) else None
        if is_plain_file_name(file_name) and (folder / file_name).is_file() and not (folder / file_name).is_symlink():
            (folder / file_name).unlink()
    index = folder / OFFLOAD_INDEX
    if index.is_file() and not index.is_symlink():
        index.unlink()
