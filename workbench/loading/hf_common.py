"""Reading an HF ``config.json`` field by field, with errors that name the field and the file.

Every architecture family module (``hf_gpt2``, ``hf_llama``) maps an HF config onto
``ModelConfig`` through ``HFConfig``, so "a value we cannot honour" is reported the same way
everywhere: ``ConfigError("<file>: field 'rope_scaling' ...")``.
"""

from __future__ import annotations

from typing import Any

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.loading.common import cannot_honour

_MISSING = object()

# HF activation names (transformers' ACT2FN keys) -> ours. Anything else is refused by name.
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_new",  # the same tanh approximation, computed by torch
    "gelu_fast": "gelu_new",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
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

    def rotary(self, head_dim: int, default_base: float = 10000.0) -> dict[str, Any]:
        """``rotary_base``/``rotary_dim`` from ``rope_parameters`` (transformers 5) or the older
        ``rope_theta``/``rope_scaling``/``partial_rotary_factor`` fields.

        Only plain RoPE is supported; a scaled variant (linear, dynamic, yarn, llama3, ...) is an
        error naming the field rather than a model that silently diverges at long range.
        """
        params = self.get("rope_parameters", {})
        scaling = self.get("rope_scaling")
        for field, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
            if isinstance(spec, dict):
                kind = spec.get("rope_type", spec.get("type", "default"))
                if kind not in ("default", None):
                    raise self.refuse(f"{field}.rope_type", kind, "only unscaled ('default') RoPE is supported")
            elif spec is not None:
                raise self.refuse(field, spec, "expected a mapping")
        base = params.get("rope_theta", self.get("rope_theta", default_base))
        factor = params.get("partial_rotary_factor", self.get("partial_rotary_factor", 1.0))
        rotary_dim = int(head_dim * factor)
        if rotary_dim <= 0 or rotary_dim % 2:
            raise self.refuse("partial_rotary_factor", factor, f"gives an odd or empty rotary dimension for head_dim={head_dim}")
        return {"positional": "rotary", "rotary_base": float(base), "rotary_dim": rotary_dim}

    def model_config(self, **fields: Any) -> ModelConfig:
        """``ModelConfig(**fields)``, with a validation failure re-raised naming this file."""
        try:
            return ModelConfig(**fields)
        except ConfigError as error:
            raise ConfigError(f"{self.source}: {error}") from error

