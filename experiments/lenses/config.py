"""tuned-lens 0.2's ``TunedLensConfig``: what its ``config.json`` holds, with the same field names."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from workbench.errors import ConfigError


@dataclass
class TunedLensConfig:
    """tuned-lens 0.2's ``TunedLensConfig``: the fields its ``config.json`` holds, with the same names.

    Example:
        >>> TunedLensConfig("toy-attn-2l", d_model=128, num_hidden_layers=2).lens_type
        'linear_tuned_lens'
    """

    base_model_name_or_path: str
    d_model: int
    num_hidden_layers: int
    bias: bool = True
    base_model_revision: Optional[str] = None
    unembed_hash: Optional[str] = None
    lens_type: str = "linear_tuned_lens"

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict tuned-lens writes.

        Example:
            >>> TunedLensConfig("m", 4, 2).to_dict()["num_hidden_layers"]
            2
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, config: dict) -> "TunedLensConfig":
        """Reads tuned-lens's ``config.json`` dict; unknown keys are ignored (as tuned-lens does), missing or
        mistyped required ones raise ``ConfigError``.

        Example:
            >>> TunedLensConfig.from_dict({"base_model_name_or_path": "m", "d_model": 4, "num_hidden_layers": 2,
            ...                            "extra": 1}).d_model
            4
        """
        if not isinstance(config, dict):
            raise ConfigError(f"a tuned lens's config.json must hold an object, got {type(config).__name__}")
        known = {field.name for field in fields(cls)}
        kept = {key: value for key, value in config.items() if key in known}
        for key in ("d_model", "num_hidden_layers"):
            if isinstance(kept.get(key), bool) or not isinstance(kept.get(key), int) or kept[key] < 1:
                raise ConfigError(f"config.json: {key} must be a positive integer, got {config.get(key)!r}")
        if kept.get("lens_type", "linear_tuned_lens") != "linear_tuned_lens":
            raise ConfigError(f"config.json: lens_type {kept['lens_type']!r} is not supported (only 'linear_tuned_lens')")
        kept.setdefault("base_model_name_or_path", "")
        return cls(**kept)
