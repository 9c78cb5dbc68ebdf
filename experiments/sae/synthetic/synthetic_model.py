"""``SyntheticModel``: a feature dictionary, its activation generator, hierarchy and correlation from one config, and
SAELens's saved synthetic models (``SyntheticModel.save`` folders, SynthSAEBench-16k's layout) read safely.

A folder holds ``synthetic_model_config.json`` (the config), ``synthetic_model.safetensors`` (``feature_vectors``,
``bias``, ``firing_probabilities``, optional ``correlation_factor`` / ``correlation_diag``) and optionally
``hierarchy.json``; only JSON and safetensors are read (no pickle). Magnitudes are not saved: they are regenerated
from the config and its seed, as SAELens does.

Legend: D d_model, B batch.
``num_features`` in shapes is the number of ground-truth features.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from experiments.sae.synthetic.activation_generator import ActivationGenerator
from experiments.sae.synthetic.correlation import LowRankCorrelationMatrix, generate_random_low_rank_correlation_matrix
from experiments.sae.synthetic.feature_dictionary import FeatureDictionary, orthogonal_initializer
from experiments.sae.synthetic.firing import (FIRING_PROBABILITY_CONFIGS, MAGNITUDE_CONFIGS,
                                              ZipfianFiringProbabilityConfig, config_from_dict, generate_magnitudes)
from experiments.sae.synthetic.hierarchy import Hierarchy, HierarchyConfig, generate_hierarchy
from workbench.errors import CheckpointError, ConfigError
from workbench.safe_files import inside, read_json, save_files

SYNTHETIC_MODEL_CONFIG_FILENAME = "synthetic_model_config.json"
SYNTHETIC_MODEL_WEIGHTS_FILENAME = "synthetic_model.safetensors"
SYNTHETIC_MODEL_HIERARCHY_FILENAME = "hierarchy.json"
MAX_JSON_BYTES = 256 * 2 ** 20  # a hierarchy over a million features stays under this


@dataclass
class SyntheticModelConfig:
    """SAELens's ``SyntheticModelConfig`` (its fields and defaults; nested configs as dataclasses or dicts).

    Example:
        >>> SyntheticModelConfig(num_features=8, hidden_dim=4).firing_probability
        ZipfianFiringProbabilityConfig(exponent=1.0, max_prob=0.3, min_prob=0.01)
    """

    num_features: int
    hidden_dim: int
    firing_probability: Any = field(default_factory=ZipfianFiringProbabilityConfig)
    hierarchy: Optional[HierarchyConfig] = None
    orthogonalization: Optional[dict] = None  # {"num_steps", "lr", "chunk_size"}
    correlation: Optional[dict] = None  # {"rank", "correlation_scale", "seed"}
    std_firing_magnitudes: Any = 0.0
    mean_firing_magnitudes: Any = 1.0
    bias: Union[bool, float] = 1.0
    dtype: str = "float32"
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if self.num_features < 1 or self.hidden_dim < 1:
            raise ConfigError(f"num_features and hidden_dim must be at least 1; got {self.num_features}, "
                              f"{self.hidden_dim}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SyntheticModelConfig":
        """From the JSON SAELens saves; unknown fields are a ``ConfigError``."""
        known = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or set(raw) - known or not {"num_features", "hidden_dim"} <= set(raw):
            raise ConfigError(f"not a synthetic model config (fields {sorted(known)}); got "
                              f"{sorted(raw) if isinstance(raw, dict) else type(raw).__name__}")
        values = dict(raw)
        values["firing_probability"] = config_from_dict(raw.get("firing_probability", {"generator_name": "zipfian"}),
                                                        FIRING_PROBABILITY_CONFIGS, "firing_probability")
        for name in ("std_firing_magnitudes", "mean_firing_magnitudes"):
            if isinstance(raw.get(name), dict):
                values[name] = config_from_dict(raw[name], MAGNITUDE_CONFIGS, name)
        if raw.get("hierarchy") is not None:
            try:
                values["hierarchy"] = HierarchyConfig(**raw["hierarchy"])
            except TypeError as problem:
                raise ConfigError(f"hierarchy config: {problem}") from None
        return cls(**values)


class SyntheticModel(nn.Module):
    """Hidden activations with known features: ``sample(B) -> [B, D]``; ``sample_with_features`` also gives the
    ``[B, num_features]`` feature activations. Built from ``cfg`` (SAELens's seed offsets: hierarchy ``seed + 3``,
    correlation ``+ 4``, std magnitudes ``+ 1``, mean magnitudes ``+ 2``, all under a temporary global seed), or
    from parts.

    Example:
        >>> model = SyntheticModel(SyntheticModelConfig(num_features=8, hidden_dim=4, seed=0))
        >>> hidden, features = model.sample_with_features(3)
        >>> hidden.shape, features.shape
        (torch.Size([3, 4]), torch.Size([3, 8]))
    """

    def __init__(self, cfg: SyntheticModelConfig, feature_dict: Optional[FeatureDictionary] = None,
                 activation_generator: Optional[ActivationGenerator] = None, hierarchy: Optional[Hierarchy] = None,
                 correlation_matrix: Optional[LowRankCorrelationMatrix] = None, device: str = "cpu"):
        super().__init__()
        self.cfg, self.device_name = cfg, device
        seeded = torch.random.fork_rng() if cfg.seed is not None else contextlib.nullcontext()
        with seeded:
            if cfg.seed is not None:
                torch.manual_seed(cfg.seed)
            self.hierarchy = hierarchy or self._create_hierarchy()
            self.correlation_matrix = correlation_matrix or self._create_correlation_matrix()
            self.feature_dict = feature_dict or self._create_feature_dict()
            self.activation_generator = activation_generator or self._create_activation_generator()

    def _offset(self, offset: int) -> Optional[int]:
        return None if self.cfg.seed is None else self.cfg.seed + offset

    def _create_hierarchy(self) -> Optional[Hierarchy]:
        if self.cfg.hierarchy is None:
            return None
        return generate_hierarchy(self.cfg.num_features, self.cfg.hierarchy, seed=self._offset(3))

    def _create_correlation_matrix(self) -> Optional[LowRankCorrelationMatrix]:
        if self.cfg.correlation is None:
            return None
        return generate_random_low_rank_correlation_matrix(
            self.cfg.num_features, rank=self.cfg.correlation.get("rank", 32),
            correlation_scale=self.cfg.correlation.get("correlation_scale", 0.1), seed=self._offset(4),
            device=self.device_name, dtype=self.cfg.dtype)

    def _create_feature_dict(self) -> FeatureDictionary:
        ortho = self.cfg.orthogonalization
        initializer = orthogonal_initializer(**ortho) if ortho is not None else None
        return FeatureDictionary(self.cfg.num_features, self.cfg.hidden_dim, bias=self.cfg.bias,
                                 initializer=initializer, device=self.device_name, seed=self.cfg.seed)

    def _create_activation_generator(self) -> ActivationGenerator:
        probs = self.cfg.firing_probability.generate(self.cfg.num_features, seed=self.cfg.seed)
        hierarchy_cfg = self.cfg.hierarchy
        if self.hierarchy is not None and hierarchy_cfg is not None and hierarchy_cfg.compensate_probabilities:
            probs = (probs * self.hierarchy.compute_probability_correction_factors(probs)).clamp(max=1.0)
        return ActivationGenerator(
            self.cfg.num_features, probs,
            std_firing_magnitudes=generate_magnitudes(self.cfg.num_features, self.cfg.std_firing_magnitudes,
                                                      seed=self._offset(1)),
            mean_firing_magnitudes=generate_magnitudes(self.cfg.num_features, self.cfg.mean_firing_magnitudes,
                                                       seed=self._offset(2)),
            modify_activations=self.hierarchy.modifier if self.hierarchy is not None else None,
            correlation_matrix=self.correlation_matrix, device=self.device_name, dtype=self.cfg.dtype)

    @torch.no_grad()
    def sample(self, batch_size: int) -> Tensor:
        """``[B, D]`` hidden activations."""
        return self.feature_dict(self.activation_generator.sample(batch_size))

    @torch.no_grad()
    def sample_with_features(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """``([B, D] hidden, [B, num_features] feature)`` activations."""
        features = self.activation_generator.sample(batch_size)
        return self.feature_dict(features), features

    def forward(self, batch_size: int) -> Tensor:
        """``sample(batch_size)``."""
        return self.sample(batch_size)

    def save(self, path: Union[str, Path]) -> Path:
        """SAELens's folder layout (config JSON, safetensors weights, hierarchy JSON), written atomically."""
        import json

        cfg = {f.name: getattr(self.cfg, f.name) for f in fields(self.cfg)}
        for name in ("firing_probability", "hierarchy", "std_firing_magnitudes", "mean_firing_magnitudes"):
            if hasattr(cfg[name], "to_dict"):
                cfg[name] = cfg[name].to_dict()
        weights = {"feature_vectors": self.feature_dict.feature_vectors.data.contiguous(),
                   "bias": self.feature_dict.bias.data.contiguous(),
                   "firing_probabilities": self.activation_generator.firing_probabilities.contiguous()}
        if self.correlation_matrix is not None:
            weights["correlation_factor"] = self.correlation_matrix.correlation_factor.contiguous()
            weights["correlation_diag"] = self.correlation_matrix.correlation_diag.contiguous()
        writers = {SYNTHETIC_MODEL_CONFIG_FILENAME: lambda p: p.write_text(json.dumps(cfg, indent=2)),
                   SYNTHETIC_MODEL_WEIGHTS_FILENAME: lambda p: save_file(weights, str(p))}
        if self.hierarchy is not None:
            writers[SYNTHETIC_MODEL_HIERARCHY_FILENAME] = lambda p: p.write_text(json.dumps(self.hierarchy.to_dict()))
        return save_files(path, writers, what="synthetic model folder")

    @classmethod
    def load_from_disk(cls, path: Union[str, Path], device: str = "cpu") -> "SyntheticModel":
        """A folder ``SyntheticModel.save`` wrote (ours or SAELens's); a missing, malformed or mismatched file is a
        ``CheckpointError`` / ``ConfigError`` naming it.

        Example:
            >>> import tempfile
            >>> model = SyntheticModel(SyntheticModelConfig(num_features=6, hidden_dim=3, seed=1))
            >>> folder = model.save(tempfile.mkdtemp())
            >>> SyntheticModel.load_from_disk(folder).feature_dict.feature_vectors.shape
            torch.Size([6, 3])
        """
        folder = Path(path)
        config_path = inside(folder, SYNTHETIC_MODEL_CONFIG_FILENAME, must_exist=True)
        cfg = SyntheticModelConfig.from_dict(read_json(config_path, MAX_JSON_BYTES, "a synthetic model config"))
        weights_path = inside(folder, SYNTHETIC_MODEL_WEIGHTS_FILENAME, must_exist=True)
        try:
            weights = load_file(str(weights_path), device=device)
        except (SafetensorError, OSError) as problem:
            raise CheckpointError(f"{weights_path}: not a readable safetensors file ({problem})") from None
        _check_weights(weights, cfg, weights_path)
        hierarchy = None
        hierarchy_path = inside(folder, SYNTHETIC_MODEL_HIERARCHY_FILENAME)
        if hierarchy_path.exists():
            hierarchy = Hierarchy.from_dict(read_json(hierarchy_path, MAX_JSON_BYTES, "a hierarchy file"))
            if any(i >= cfg.num_features for root in hierarchy.roots for i in root.get_all_feature_indices()):
                raise CheckpointError(f"{hierarchy_path}: names a feature beyond num_features={cfg.num_features}")
        correlation = None
        if "correlation_factor" in weights:
            correlation = LowRankCorrelationMatrix(weights["correlation_factor"], weights["correlation_diag"])
        feature_dict = FeatureDictionary(cfg.num_features, cfg.hidden_dim, bias=cfg.bias, initializer=None,
                                         device=device)
        feature_dict.feature_vectors.data = weights["feature_vectors"]
        feature_dict.bias.data = weights["bias"]
        model = cls(cfg, feature_dict=feature_dict, hierarchy=hierarchy, correlation_matrix=correlation,
                    device=device)
        # SAELens overrides the probabilities after building the generator (its copula thresholds keep the
        # config's); the same here, so a loaded model samples as SAELens's does
        model.activation_generator.firing_probabilities = weights["firing_probabilities"]
        return model


def _check_weights(weights: dict[str, Tensor], cfg: SyntheticModelConfig, path: Path) -> None:
    expected = {"feature_vectors": (cfg.num_features, cfg.hidden_dim), "bias": (cfg.hidden_dim,),
                "firing_probabilities": (cfg.num_features,)}
    if "correlation_factor" in weights or "correlation_diag" in weights:
        rank = weights.get("correlation_factor", torch.zeros(0, 0)).shape[-1]
        expected.update(correlation_factor=(cfg.num_features, rank), correlation_diag=(cfg.num_features,))
    for name, shape in expected.items():
        if name not in weights:
            raise CheckpointError(f"{path}: missing tensor {name!r}")
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(f"{path}: {name} has shape {tuple(weights[name].shape)}; the config says {shape}")
