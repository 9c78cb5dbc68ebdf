"""Per-feature firing probabilities and magnitudes (SAELens 6.54's ``firing_probabilities`` and
``firing_magnitudes``: the functions and the configs its saved synthetic models name, ``generator_name`` keyed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import torch
from jaxtyping import Float
from torch import Tensor

from workbench.errors import ConfigError, InputError


def zipfian_firing_probabilities(num_features: int, exponent: float = 1.0, max_prob: float = 0.3,
                                 min_prob: float = 0.01) -> Float[Tensor, "num_features"]:
    """``1 / rank^exponent`` rescaled to ``[min_prob, max_prob]``, descending (a few frequent, most rare features).

    Example:
        >>> zipfian_firing_probabilities(3)
        tensor([0.3000, 0.0825, 0.0100])
    """
    if num_features < 1 or exponent <= 0 or not 0 < min_prob < max_prob <= 1:
        raise InputError("zipfian_firing_probabilities needs num_features >= 1, exponent > 0 and "
                         f"0 < min_prob < max_prob <= 1; got {num_features}, {exponent}, {min_prob}, {max_prob}")
    if num_features == 1:
        return torch.tensor([max_prob])
    probs = 1.0 / torch.arange(1, num_features + 1, dtype=torch.float32) ** exponent
    return min_prob + (max_prob - min_prob) * (probs - probs.min()) / (probs.max() - probs.min())


def linear_firing_probabilities(num_features: int, max_prob: float = 0.3,
                                min_prob: float = 0.01) -> Float[Tensor, "num_features"]:
    """Linearly decaying from ``max_prob`` to ``min_prob``.

    Example:
        >>> linear_firing_probabilities(3, max_prob=0.5, min_prob=0.1)
        tensor([0.5000, 0.3000, 0.1000])
    """
    if num_features < 1 or not 0 < min_prob <= max_prob <= 1:
        raise InputError("linear_firing_probabilities needs num_features >= 1 and 0 < min_prob <= max_prob <= 1")
    return torch.tensor([max_prob]) if num_features == 1 else torch.linspace(max_prob, min_prob, num_features)


def random_firing_probabilities(num_features: int, max_prob: float = 0.5, min_prob: float = 0.01,
                                seed: Optional[int] = None) -> Float[Tensor, "num_features"]:
    """Uniform in ``[min_prob, max_prob]``.

    Example:
        >>> bool(((p := random_firing_probabilities(5, seed=0)) >= 0.01).all() and (p <= 0.5).all())
        True
    """
    if num_features < 1 or not 0 < min_prob < max_prob <= 1:
        raise InputError("random_firing_probabilities needs num_features >= 1 and 0 < min_prob < max_prob <= 1")
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(seed)
    return min_prob + (max_prob - min_prob) * torch.rand(num_features, generator=generator, dtype=torch.float32)


@dataclass
class _Named:
    """A config serialised with its ``generator_name`` (SAELens's saved-model JSON)."""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "generator_name": self.generator_name}


@dataclass
class ZipfianFiringProbabilityConfig(_Named):
    exponent: float = 1.0
    max_prob: float = 0.3
    min_prob: float = 0.01
    generator_name = "zipfian"

    def generate(self, num_features: int, seed: Optional[int] = None) -> Tensor:
        return zipfian_firing_probabilities(num_features, self.exponent, self.max_prob, self.min_prob)


@dataclass
class LinearFiringProbabilityConfig(_Named):
    max_prob: float = 0.3
    min_prob: float = 0.01
    generator_name = "linear"

    def generate(self, num_features: int, seed: Optional[int] = None) -> Tensor:
        return linear_firing_probabilities(num_features, self.max_prob, self.min_prob)


@dataclass
class RandomFiringProbabilityConfig(_Named):
    max_prob: float = 0.5
    min_prob: float = 0.01
    generator_name = "random"

    def generate(self, num_features: int, seed: Optional[int] = None) -> Tensor:
        return random_firing_probabilities(num_features, self.max_prob, self.min_prob, seed=seed)


@dataclass
class ConstantFiringProbabilityConfig(_Named):
    probability: float = 0.1
    generator_name = "constant"

    def generate(self, num_features: int, seed: Optional[int] = None) -> Tensor:
        return torch.full((num_features,), self.probability, dtype=torch.float32)


@dataclass
class ConstantMagnitudeConfig(_Named):
    value: float = 1.0
    generator_name = "constant"

    def generate(self, num_features: int, seed: Optional[int] = None) -> Tensor:
        return torch.full((num_features,), self.value, dtype=torch.float32)


@dataclass
class LinearMagnitudeConfig(_Named):
    start: float
    end: float
    generator_name = "linear"

    def generate(self, num_features: int, seed: Optional[int] = None) -> Tensor:
        return torch.tensor([self.start]) if num_features == 1 else torch.linspace(self.start, self.end, num_features)


@dataclass
class ExponentialMagnitudeConfig(_Named):
    start: float
    end: float
    generator_name = "exponential"

    def generate(self, num_features: int, seed: Optional[int] = None) -> Tensor:
        if num_features == 1:
            return torch.tensor([self.start])
        return self.start * (self.end / self.start) ** torch.linspace(0, 1, num_features)


@dataclass
class FoldedNormalMagnitudeConfig(_Named):
    mean: float = 0.0
    std: float = 0.1
    min_value: Optional[float] = None
    max_value: Optional[float] = None
    generator_name = "folded_normal"

    def generate(self, num_features: int, seed: Optional[int] = None) -> Tensor:
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        samples = (self.mean + torch.randn(num_features, generator=generator) * self.std).abs()
        if self.min_value is not None or self.max_value is not None:
            samples = samples.clamp(min=self.min_value, max=self.max_value)
        return samples


FIRING_PROBABILITY_CONFIGS = {c.generator_name: c for c in (ZipfianFiringProbabilityConfig,
                                                            LinearFiringProbabilityConfig,
                                                            RandomFiringProbabilityConfig,
                                                            ConstantFiringProbabilityConfig)}
MAGNITUDE_CONFIGS = {c.generator_name: c for c in (ConstantMagnitudeConfig, LinearMagnitudeConfig,
                                                   ExponentialMagnitudeConfig, FoldedNormalMagnitudeConfig)}


def config_from_dict(raw: dict[str, Any], table: dict[str, type], what: str) -> Any:
    """The config ``raw`` names by ``generator_name`` in ``table`` (``FIRING_PROBABILITY_CONFIGS`` or
    ``MAGNITUDE_CONFIGS``); an unknown name or field is a ``ConfigError``.

    Example:
        >>> config_from_dict({"generator_name": "zipfian", "exponent": 0.5}, FIRING_PROBABILITY_CONFIGS, "firing")
        ZipfianFiringProbabilityConfig(exponent=0.5, max_prob=0.3, min_prob=0.01)
    """
    fields = dict(raw)
    name = fields.pop("generator_name", None)
    if name not in table:
        raise ConfigError(f"{what}: unknown generator_name {name!r}; known: {sorted(table)}")
    try:
        return table[name](**fields)
    except TypeError as problem:
        raise ConfigError(f"{what} {name!r}: {problem}") from None


def generate_magnitudes(num_features: int, config: Union[float, Any], seed: Optional[int] = None) -> Tensor:
    """Per-feature magnitudes: a float for all, or a magnitude config's ``generate``.

    Example:
        >>> generate_magnitudes(2, 1.5), generate_magnitudes(3, LinearMagnitudeConfig(1.0, 2.0))
        (tensor([1.5000, 1.5000]), tensor([1.0000, 1.5000, 2.0000]))
    """
    if isinstance(config, (int, float)):
        return torch.full((num_features,), float(config), dtype=torch.float32)
    return config.generate(num_features, seed=seed)
