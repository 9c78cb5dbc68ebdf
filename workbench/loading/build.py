"""Every loader's last step: the ``Decoder`` holding the tensors a loader has read, converted and checked.

``build_model`` puts the model on one device, or (with a ``Placement``) hands it to
``build_dispatched``, which builds it without memory, sends each tensor straight to the device
``workbench.loading.placement`` maps its unit to (or into the offload folder for "disk") and lets
``accelerate.dispatch_model`` add the hooks that move activations between devices.

The load's runtime options (``dtype``, ``attn_impl``, what a saved model kept) become the model's
``RuntimeOptions`` in one function, ``runtime_options``: loaders pass them to ``build_model`` and never build
options themselves (they may call it early, so a bad option fails before any tensor is read).
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

from workbench.config import ModelConfig
from workbench.extras import require
from workbench.loading.placement import (OFFLOAD_INDEX, Placement, accelerate_device, clear_offload,
                                         prepare_offload_folder, resolve_device_map, unit_of, units)
from workbench.loading.weights import assign_weights, check_weights
from workbench.model import Decoder
from workbench.options import RuntimeOptions
from workbench.tokenizer import Tokenizer

FEATURE = "device maps and offloading"


def runtime_options(cfg: ModelConfig, *, dtype: Optional[torch.dtype] = None, attn_impl: Optional[str] = None,
                    saved: Optional[dict[str, Any]] = None) -> RuntimeOptions:
    """The ``RuntimeOptions`` a load gives its model: what a saved model kept (``saved``), then the load's
    own ``dtype`` and ``attn_impl`` (None keeps the saved or default one), checked against the architecture
    (a ``ConfigError`` naming the option): the one place a load's options meet the model.

    Example:
        >>> options = runtime_options(model.config, dtype=torch.bfloat16, attn_impl="eager")
        >>> options.dtype, options.attn_impl, options.device
        (torch.bfloat16, 'eager', 'cpu')
        >>> runtime_options(model.config, attn_impl="fast")
        Traceback (most recent call last):
        ...
        workbench.errors.ConfigError: attn_impl must be one of ('eager', 'sdpa', 'flash'), got 'fast'
    """
    chosen = {name: value for name, value in (("dtype", dtype), ("attn_impl", attn_impl)) if value is not None}
    options = RuntimeOptions(**{**(saved or {}), **chosen})
    options.check_for(cfg)
    return options


def empty_model(cfg: ModelConfig, tokenizer: Optional[Tokenizer] = None,
                options: Optional[RuntimeOptions] = None) -> Decoder:
    """A ``Decoder`` whose parameters are on the meta device (no memory), tied as in a real one, and
    whose tables (RoPE, ALiBi, sinusoidal) are real CPU buffers: parameter shapes and placement
    without the weights.

    Example:
        >>> meta = empty_model(model.config)
        >>> meta.embed.W_E.device, meta.embed.W_E.shape == model.embed.W_E.shape
        (device(type='meta'), True)
    """
    with torch.device("meta"):
        return Decoder(cfg, tokenizer=tokenizer, init_weights=False, **dataclasses.asdict(options or RuntimeOptions()))


def build_model(cfg: ModelConfig, tokenizer: Optional[Tokenizer], tensors: dict[str, Tensor], source: str, *,
                dtype: Optional[torch.dtype] = None, attn_impl: Optional[str] = None, device: str = "cpu",
                placement: Optional[Placement] = None, saved_options: Optional[dict[str, Any]] = None) -> Decoder:
    """Every loader's last step: the model holding ``tensors`` (read and converted by the loader), in
    ``dtype`` with ``attn_impl`` (None: a saved model's ``saved_options``, else the defaults), on ``device`` or
    placed across devices by ``placement``; in eval mode. The tensors are handed over (each becomes its
    parameter's storage).

    Example:
        >>> tensors = {name: p.detach().clone() for name, p in model.state_dict().items()}
        >>> rebuilt = build_model(model.config, model.tokenizer, tensors, "in memory", dtype=torch.float64)
        >>> rebuilt.cfg.dtype, torch.allclose(rebuilt(tokens), model(tokens).double(), atol=1e-4)
        (torch.float64, True)
    """
    options = runtime_options(cfg, dtype=dtype, attn_impl=attn_impl, saved=saved_options)
    if placement is not None:
        return build_dispatched(cfg, tokenizer, tensors, source, placement, options)
    # Built once, on the meta device: names and shapes are checked before any parameter has memory (sizes a
    # config declares but its tensors lack, a hostile d_vocab=1e9, are refused unallocated), then each meta
    # parameter takes its tensor's place (building the Decoder is a third of a cached SmolLM2 load).
    model = empty_model(cfg, tokenizer, options)
    assign_weights(model, tensors, source, move=True)
    return model.to(device).eval()  # .to() records the device in the options


def build_dispatched(cfg: ModelConfig, tokenizer: Optional[Tokenizer], tensors: dict[str, Tensor], source: str,
                     placement: Placement, options: Optional[RuntimeOptions] = None) -> Decoder:
    """A ``Decoder`` holding ``tensors`` placed by ``placement`` and dispatched by accelerate.

    Each tensor goes from the loader straight to its unit's device (cast to ``options.dtype``) or into the
    offload folder; the model's ``device_map`` attribute records the map and ``cfg.device`` is the
    embedding's device (where tokens go). On any error the files written so far are removed.

    Example:
        >>> tensors = {name: p.detach().clone() for name, p in model.state_dict().items()}
        >>> spread = build_dispatched(model.config, model.tokenizer, tensors, "in memory",
        ...                           Placement({"embed": "cpu", "blocks": "cpu", "ln_final": "cpu", "unembed": "cpu"}))
        >>> spread.device_map["blocks.1"], torch.equal(spread(tokens), model(tokens))
        ('cpu', True)
    """
    require("accelerate", FEATURE)
    from accelerate import dispatch_model
    from accelerate.utils import find_tied_parameters, offload_weight, retie_parameters, set_module_tensor_to_device

    model = empty_model(cfg, tokenizer, options)
    check_weights(model, tensors, source)
    device_map = resolve_device_map(model, placement)
    folder = prepare_offload_folder(placement.offload_folder, device_map)
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
                set_module_tensor_to_device(model, name, accelerate_device(device), value=value)
        retie_parameters(model, ties)
        if index:
            (folder / OFFLOAD_INDEX).write_text(json.dumps(index, indent=1))
        main_device = "cpu" if "cpu" in device_map.values() or "disk" in device_map.values() else \
            accelerate_device(device_map[first])
        with _quiet_accelerate():
            dispatch_model(model, {unit: accelerate_device(device) for unit, device in device_map.items()},
                           main_device=main_device, offload_dir=str(folder) if folder else None,
                           offload_index=index or None,  # accelerate would look for its own "index.json"
                           preload_module_classes=["TransformerBlock"], force_hooks=True)
    except BaseException:
        if folder is not None:
            clear_offload(folder, index)  # what this load wrote, index file or not
        raise
    model.options.device = device_map[first]  # dispatch moves weights without .to()
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
