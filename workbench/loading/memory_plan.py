"""Before loading: where ``load_model(..., device_map=...)`` would put each unit, and the bytes per device of
its weights and of a ``run_with_cache``, from a model on the meta device (nothing is read but the config).

``wb.plan_memory`` and ``workbench plan SOURCE`` show this table.
"""

from __future__ import annotations

import pandas as pd
import torch
from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.build import empty_model
from workbench.loading.placement import Placement, resolve_device_map, unit_bytes, unit_of
from workbench.memory import readable_bytes
from workbench.model import Decoder
from workbench.options import RuntimeOptions


def plan(cfg: ModelConfig, placement: Placement, batch: int = 1, pos: int = 1024,
         names_filter=None, dtype: torch.dtype = torch.float32) -> pd.DataFrame:
    """Per device: the units placed there, their weights' bytes, and the bytes ``run_with_cache`` of
    ``batch`` x ``pos`` tokens caches there (every hook, or ``names_filter``'s; each hook's activation
    stays on its block's device), the weights in ``dtype``. Nothing is loaded: the shapes come from a forward
    pass on the meta device.

    Example:
        >>> table = plan(model.config, Placement({"embed": "cpu", "ln_final": "cpu", "unembed": "cpu",
        ...                                    "blocks.0": "cpu", "blocks.1": "disk"}), batch=2, pos=8)
        >>> table[["device", "units", "weights", "cache_on"]]
          device                              units  weights cache_on
        0    cpu  embed, ln_final, unembed, blocks.0  ...     cpu
        1   disk                           blocks.1  ...     cpu
    """
    model = empty_model(cfg, options=RuntimeOptions(dtype=dtype))
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

