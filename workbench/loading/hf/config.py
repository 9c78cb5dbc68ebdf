"""Reading an HF ``config.json`` field by field, with errors that name the field and the file.

Every architecture family module (``gpt2``, ``llama``) maps an HF config onto
``ModelConfig`` through ``HFConfig``, so "a value we cannot honour" is reported the same way
everywhere: ``ConfigError("<file>: field 'rope_scaling' ...")``.
"""

from __future__ import annotations

from typing import Any, Optional

from workbench.config import PER_LAYER_FIELDS, ROTARY_SCALINGS, ModelConfig
from workbench.errors import ConfigError
from workbench.loading.common import cannot_honour

_MISSING = object()
# Keys of a RoPE scaling spec that ModelConfig.rotary_scaling keeps (transformers' names).
_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                      "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
                      "short_factor", "long_factor")

# HF activation names (transformers' ACT2FN keys) -> ours. Anything else is refused by name.
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_new",  # the same tanh approximation, computed by torch
    "gelu_fast": "gelu_new",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
    "relu2": "relu2",  # squared ReLU (Nemotron, Arcee)
    "xielu": "xielu",  # Apertus (learned scalars per layer)
}


class HFConfig:
    """A parsed ``config.json`` plus the path it came from, for error messages.

    Example:
        >>> cfg = HFConfig({"hidden_size": 64}, "ckpt/config.json")
        >>> cfg.require("hidden_size")
        64
        >>> cfg.get("rms_norm_eps", 1e-6)
        1e-06
    """

    def __init__(self, data: dict[str, Any], source: str):
        self.data = data
        self.source = source

    def get(self, field: str, default: Any = None) -> Any:
        """The field's value; ``default`` when it is absent or null."""
        value = self.data.get(field, _MISSING)
        return default if value is _MISSING or value is None else value

    def require(self, field: str) -> Any:
        """The field's value, or a ``ConfigError`` naming the field and the file."""
        value = self.data.get(field)
        if value is None:
            raise ConfigError(f"{self.source}: required field '{field}' is missing")
        return value

    def refuse(self, field: str, value: Any, why: str) -> ConfigError:
        """The error for a value we cannot honour (returned, so callers ``raise`` it visibly)."""
        return cannot_honour(self.source, field, value, why)

    def activation(self, field: str) -> str:
        name = self.require(field)
        if name not in HF_ACTIVATIONS:
            raise self.refuse(field, name, f"supported activations are {sorted(HF_ACTIVATIONS)}")
        return HF_ACTIVATIONS[name]

    def rotary(self, head_dim: int, default_base: float = 10000.0, layer_type: Optional[str] = None,
               longrope: bool = False) -> dict[str, Any]:
        """``positional``, ``rotary_base``, ``rotary_dim`` and ``rotary_scaling`` from ``rope_parameters``
        (transformers 5; per layer type when keyed by it, as Gemma 3's is) or the older
        ``rope_theta``/``rope_scaling``/``partial_rotary_factor`` fields.

        Scalings ``linear``, ``dynamic``, ``llama3`` and ``yarn`` are honoured, ``longrope`` where the caller
        says its architecture runs it as transformers' ``_compute_longrope_parameters`` (Phi-3); any other is
        an error naming the field rather than a model that silently diverges at long range.

        Example:
            >>> hf = HFConfig({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
            ...                "max_position_embeddings": 64}, "config.json")
            >>> hf.rotary(8)["rotary_scaling"]
            {'rope_type': 'linear', 'factor': 4.0}
        """
        params, field = self.get("rope_parameters", {}), "rope_parameters"
        if not isinstance(params, dict):
            raise self.refuse(field, params, "expected a mapping")
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params, field = params[layer_type], f"rope_parameters.{layer_type}"
        legacy = self.get("rope_scaling") or {}
        if not isinstance(legacy, dict):
            raise self.refuse("rope_scaling", legacy, "expected a mapping")
        kind = params.get("rope_type", "default")
        legacy_kind = legacy.get("rope_type") or legacy.get("type") or "default"
        if kind == "default" and legacy_kind != "default":  # a scaling written the older way is never ignored
            kind, field = legacy_kind, "rope_scaling"
        spec = {**params, **legacy} if field == "rope_scaling" else {**legacy, **params}
        base = float(spec.get("rope_theta", self.get("rope_theta", default_base)))
        factor = spec.get("partial_rotary_factor", self.get("partial_rotary_factor", 1.0))
        rotary_dim = int(head_dim * factor)
        if rotary_dim <= 0 or rotary_dim % 2:
            raise self.refuse("partial_rotary_factor", factor, f"gives an odd or empty rotary dimension for head_dim={head_dim}")
        out = {"positional": "rotary", "rotary_base": base, "rotary_dim": rotary_dim, "rotary_scaling": None}
        if kind == "default":
            return out
        honoured = [name for name in ROTARY_SCALINGS if longrope or name != "longrope"]
        if kind not in honoured:
            raise self.refuse(f"{field}.rope_type", kind, f"supported RoPE types are {['default', *honoured]}")
        scaling = {"rope_type": kind, **{key: spec[key] for key in _ROPE_SCALING_KEYS if spec.get(key) is not None}}
        if "original_max_position_embeddings" in ROTARY_SCALINGS[kind]:
            scaling.setdefault("original_max_position_embeddings",
                               self.get("original_max_position_embeddings", self.get("max_position_embeddings")))
        for key in ("short_factor", "long_factor") if kind == "longrope" else ():
            if not isinstance(spec.get(key), list) or len(spec[key]) != rotary_dim // 2:
                raise self.refuse(f"{field}.{key}", spec.get(key), f"longrope needs a list of rotary_dim / 2 = "
                                                                 f"{rotary_dim // 2} numbers")
        if kind in ("yarn", "longrope") and scaling.get("factor") is None:  # transformers: the context's growth
            scaling["factor"] = self.require("max_position_embeddings") / scaling["original_max_position_embeddings"]
        out["rotary_scaling"] = scaling
        return out

    def layer_types(self, n_layers: int) -> Optional[list[str]]:
        """transformers' per-layer attention kinds ("full_attention" / "sliding_attention"), or None.

        Example:
            >>> HFConfig({"layer_types": ["sliding_attention", "full_attention"]}, "c.json").layer_types(2)
            ['sliding_attention', 'full_attention']
        """
        kinds = self.get("layer_types")
        if kinds is None:
            return None
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if unknown:
            raise self.refuse("layer_types", unknown, "supported layer types are 'full_attention' and 'sliding_attention'")
        if len(kinds) != n_layers:
            raise self.refuse("layer_types", f"{len(kinds)} entries", f"expected one per layer ({n_layers})")
        return list(kinds)

    def attention_layers(self, n_layers: int, head_dim: int) -> dict[str, Any]:
        """Per-layer attention fields (``sliding_window``, the RoPE fields, NoPE layers) as
        ``ModelConfig`` fields, ``layer_overrides`` included.

        Reads ``layer_types`` (a sliding layer gets ``sliding_window``), else the older
        ``use_sliding_window``/``max_window_layers`` pair (Qwen2: sliding from that layer on), else
        one ``sliding_window`` for every layer (Mistral); the RoPE of each layer type
        (``rope_parameters`` keyed by it: Gemma 3's local base) and ``no_rope_layers`` (SmolLM3:
        0 = no RoPE in that layer).

        Example:
            >>> hf = HFConfig({"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}, "c.json")
            >>> hf.attention_layers(2, 8)["layer_overrides"]
            ({}, {'sliding_window': None})
        """
        window = self.get("sliding_window")
        kinds = self.layer_types(n_layers)
        if kinds is None:
            if "use_sliding_window" in self.data:
                first = int(self.get("max_window_layers", 0))
                on = bool(self.get("use_sliding_window", False)) and window is not None
                kinds = ["sliding_attention" if on and i >= first else "full_attention" for i in range(n_layers)]
            else:
                kinds = ["full_attention" if window is None else "sliding_attention"] * n_layers
        if "sliding_attention" in kinds and window is None:
            raise self.refuse("sliding_window", None, "layer_types has sliding-window layers but no window size")
        no_rope = self.get("no_rope_layers")
        if no_rope is not None and len(no_rope) != n_layers:
            raise self.refuse("no_rope_layers", no_rope, f"expected one entry per layer ({n_layers})")
        layers = []
        for layer, kind in enumerate(kinds):
            fields = {"sliding_window": int(window) if kind == "sliding_attention" else None,
                      **self.rotary(head_dim, layer_type=kind)}
            if no_rope is not None and not no_rope[layer]:
                fields["positional"] = "none"
            layers.append(fields)
        return per_layer_config(layers)

    def model_config(self, **fields: Any) -> ModelConfig:
        """``ModelConfig(**fields)``, with a validation failure re-raised naming this file."""
        try:
            return ModelConfig(**fields)
        except ConfigError as error:
            raise ConfigError(f"{self.source}: {error}") from error



def per_layer_config(layers: list[dict[str, Any]], base: int = 0) -> dict[str, Any]:
    """ModelConfig fields from one mapping of per-layer values per layer: a field every layer agrees
    on is set once; one that differs takes layer ``base``'s value for the model and ``layer_overrides``
    for the layers that differ (a mixture-of-experts model takes an MoE layer as its base, so
    ``cfg.num_experts`` is the experts' count even where its first layers are dense).

    Example:
        >>> per_layer_config([{"sliding_window": 4}, {"sliding_window": None}])
        {'sliding_window': 4, 'layer_overrides': ({}, {'sliding_window': None})}
    """
    unknown = sorted({key for layer in layers for key in layer} - set(PER_LAYER_FIELDS))
    if unknown:
        raise ValueError(f"not per-layer fields: {unknown}")
    base = dict(layers[base])
    overrides = tuple({key: value for key, value in layer.items() if value != base[key]} for layer in layers)
    return {**base, "layer_overrides": overrides if any(overrides) else ()}


def per_layer_values(fields: dict[str, Any], n_layers: int) -> list[dict[str, Any]]:
    """The inverse of ``per_layer_config``: each layer's own values of the per-layer fields in ``fields``.

    Example:
        >>> per_layer_values({"sliding_window": 4, "layer_overrides": ({}, {"sliding_window": None})}, 2)
        [{'sliding_window': 4}, {'sliding_window': None}]
    """
    base = {key: value for key, value in fields.items() if key in PER_LAYER_FIELDS}
    overrides = fields.get("layer_overrides") or ({},) * n_layers
    return [{**base, **override} for override in overrides]
