"""Which layers of a Llama-like HF checkpoint attend through a sliding window and which have no RoPE, read the way
each architecture's transformers code reads them (``llama.Variant.sliding`` names the rule, a key of
``SLIDING_RULES``; ``Variant.nope_layers`` switches SmolLM3's NoPE layers on).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from workbench.loading.hf.config import HFConfig


def attention_layers(hf: HFConfig, sliding: str, nope_layers: bool, n_layers: int, head_dim: int) -> dict[str, Any]:
    """Sliding windows, RoPE and NoPE per layer (``HFConfig.attention_layers``), from the layer kinds this
    architecture's transformers code masks with: ``sliding`` names its rule in ``SLIDING_RULES``, ``nope_layers``
    says whether it honours ``no_rope_layers``.

    Example:
        >>> hf = HFConfig({"sliding_window": 8}, "config.json")
        >>> attention_layers(hf, "every_layer", False, n_layers=2, head_dim=4)["sliding_window"]
        8
    """
    kinds, window = SLIDING_RULES[sliding](hf, n_layers)
    data = {**hf.data, "layer_types": kinds, "sliding_window": window}
    if nope_layers:
        data["no_rope_layers"] = _no_rope_layers(hf, n_layers)
    else:
        data.pop("no_rope_layers", None)  # transformers' code for these has no NoPE layers
    return HFConfig(data, hf.source).attention_layers(n_layers, head_dim)


def _no_sliding(hf: HFConfig, n_layers: int) -> tuple[list[str], None]:
    """Llama, OLMo, OLMo 2: transformers masks causally only, so a window is refused, not dropped."""
    window = hf.get("sliding_window")
    if window is not None:
        raise hf.refuse("sliding_window", window, "this architecture has no sliding-window attention")
    return ["full_attention"] * n_layers, None


def _every_layer(hf: HFConfig, n_layers: int) -> tuple[list[str], Optional[int]]:
    """Mistral, Mixtral: ``sliding_window`` (if set) on every layer; ``layer_types`` is ignored there."""
    window = hf.get("sliding_window")
    return ["full_attention" if window is None else "sliding_attention"] * n_layers, window


def _from_max_window_layers(hf: HFConfig, n_layers: int) -> tuple[list[str], Optional[int]]:
    """Qwen2, Qwen3: the window exists only with ``use_sliding_window``; ``layer_types`` (default:
    sliding from ``max_window_layers`` on) says which layers use it."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    first = int(hf.get("max_window_layers", 0))
    default = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n_layers)]
    return hf.layer_types(n_layers) or default, window


def _qwen2_moe_layers(hf: HFConfig, n_layers: int) -> tuple[list[str], Optional[int]]:
    """Qwen2-MoE: ``layer_types`` (default, with ``use_sliding_window``: every other layer, from layer 0,
    below ``max_window_layers``); a window of 0 means none."""
    window = (hf.get("sliding_window") or None) if hf.get("use_sliding_window", False) else None
    first = int(hf.get("max_window_layers", 0))
    default = ["sliding_attention" if window is not None and (i + 1) % 2 and i < first else "full_attention"
               for i in range(n_layers)]
    return hf.layer_types(n_layers) or default, window


def _every_layer_if_used(hf: HFConfig, n_layers: int) -> tuple[list[str], Optional[int]]:
    """Qwen3-MoE: ``sliding_window`` on every layer, only with ``use_sliding_window``."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    return ["full_attention" if window is None else "sliding_attention"] * n_layers, window


def _layer_types(hf: HFConfig, n_layers: int) -> tuple[list[str], Optional[int]]:
    """gpt-oss: ``layer_types`` (default: sliding and full layers alternating, sliding first)."""
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    return hf.layer_types(n_layers) or default, hf.get("sliding_window")


def _nope_layers(hf: HFConfig, n_layers: int) -> tuple[list[str], Optional[int]]:
    """SmolLM3: ``layer_types`` (default: sliding on the NoPE layers, with ``use_sliding_window``)."""
    window = hf.get("sliding_window")
    has_rope = _no_rope_layers(hf, n_layers)
    on = bool(hf.get("use_sliding_window", False)) and window is not None
    default = ["sliding_attention" if on and not has_rope[i] else "full_attention" for i in range(n_layers)]
    return hf.layer_types(n_layers) or default, window


def _no_rope_layers(hf: HFConfig, n_layers: int) -> list[int]:
    """SmolLM3's RoPE switch per layer (1: RoPE, 0: none); default: none in every
    ``no_rope_layer_interval``-th layer."""
    interval = int(hf.get("no_rope_layer_interval", 4))
    layers = hf.get("no_rope_layers", [int((i + 1) % interval != 0) for i in range(n_layers)])
    if len(layers) != n_layers:
        raise hf.refuse("no_rope_layers", layers, f"expected one entry per layer ({n_layers})")
    return list(layers)


SLIDING_RULES: dict[str, Callable[[HFConfig, int], tuple[list[str], Optional[int]]]] = {
    "none": _no_sliding, "every_layer": _every_layer, "from_max_window_layers": _from_max_window_layers,
    "nope_layers": _nope_layers, "qwen2_moe": _qwen2_moe_layers, "every_layer_if_used": _every_layer_if_used,
    "layer_types": _layer_types,
}
