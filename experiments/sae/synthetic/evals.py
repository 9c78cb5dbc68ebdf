"""``eval_sae_on_synthetic_data``: an SAE scored against the known ground truth (SAELens 6.54's
``sae_lens.synthetic.evals``: its fields, its definitions, its streaming sums).

MCC: the mean absolute cosine similarity of decoder rows and true features after the best one-to-one matching
(Hungarian, ``matching.linear_sum_assignment``); uniqueness: distinct best-matched true features per latent;
classification: each latent as a detector of its best-matched true feature (mean precision, recall, F1, accuracy).
Legend: X d_sae, D d_model, B batch.
``num_features`` in shapes is the number of ground-truth features.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

import torch
from jaxtyping import Float
from torch import Tensor

from experiments.sae.synthetic.activation_generator import ActivationGenerator
from experiments.sae.synthetic.feature_dictionary import FeatureDictionary
from experiments.sae.synthetic.matching import linear_sum_assignment
from workbench.errors import InputError
from workbench.sae import SAE, SAEConfig


def cosine_similarities(mat1: Float[Tensor, "X D"],
                        mat2: Optional[Float[Tensor, "num_features D"]] = None) -> Float[Tensor, "X num_features"]:
    """Row-by-row cosine similarities (norms clamped at 1e-8, as SAELens).

    Example:
        >>> cosine_similarities(torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[2.0, 0.0]]))
        tensor([[1.0000],
                [0.7071]])
    """
    mat2 = mat1 if mat2 is None else mat2
    return (mat1 / mat1.norm(dim=1, keepdim=True).clamp(min=1e-8)) @ (
        mat2 / mat2.norm(dim=1, keepdim=True).clamp(min=1e-8)).T


def mean_correlation_coefficient(features_a: Float[Tensor, "X D"],
                                 features_b: Float[Tensor, "num_features D"]) -> float:
    """MCC: mean |cosine| of the pairs of the best one-to-one matching.

    Example:
        >>> round(mean_correlation_coefficient(torch.eye(2), torch.tensor([[0.0, -1.0], [1.0, 0.0]])), 4)
        1.0
    """
    similarity = cosine_similarities(features_a, features_b).abs()
    rows, cols = linear_sum_assignment(1 - similarity.detach().cpu().double().numpy())
    return similarity[torch.as_tensor(rows), torch.as_tensor(cols)].mean().item()


def feature_uniqueness(sae_features: Float[Tensor, "X D"], gt_features: Float[Tensor, "num_features D"]) -> float:
    """Distinct best-matching true features over the number of latents (1: every latent tracks its own feature).

    Example:
        >>> feature_uniqueness(torch.tensor([[1.0, 0.0], [0.9, 0.1]]), torch.eye(2))
        0.5
    """
    if sae_features.shape[0] == 0:
        return 0.0
    best = cosine_similarities(sae_features, gt_features).abs().argmax(dim=1)
    return len(best.unique()) / sae_features.shape[0]


@dataclass
class ClassificationMetrics:
    """Mean over latents of precision, recall, F1 and accuracy as detectors of their best-matched feature."""

    precision: float
    recall: float
    f1_score: float
    accuracy: float


class ClassificationMetricsCalculator:
    """Per-latent true / false positive / negative counts over batches (a latent fires when it is nonzero).

    Example:
        >>> calc = ClassificationMetricsCalculator(torch.eye(2), torch.eye(2))
        >>> calc.add_batch(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
        >>> calc.compute()
        ClassificationMetrics(precision=0.25, recall=0.5, f1_score=0.3333333432674408, accuracy=0.75)
    """

    def __init__(self, sae_decoder: Float[Tensor, "X D"], gt_features: Float[Tensor, "num_features D"]):
        self.num_sae_latents = sae_decoder.shape[0]
        self.best_matches = (cosine_similarities(sae_decoder, gt_features).abs().argmax(dim=1)
                             if self.num_sae_latents else torch.empty(0, dtype=torch.long))
        self.tp, self.fp, self.fn, self.tn = (torch.zeros(self.num_sae_latents) for _ in range(4))

    def add_batch(self, sae_latents: Float[Tensor, "B X"], gt_feature_acts: Float[Tensor, "B num_features"]) -> None:
        """Counts one batch."""
        if self.num_sae_latents == 0:
            return
        sae_fires = sae_latents != 0
        gt_fires = gt_feature_acts[:, self.best_matches] > 0
        self.tp += (sae_fires & gt_fires).float().sum(dim=0).cpu()
        self.fp += (sae_fires & ~gt_fires).float().sum(dim=0).cpu()
        self.fn += (~sae_fires & gt_fires).float().sum(dim=0).cpu()
        self.tn += (~sae_fires & ~gt_fires).float().sum(dim=0).cpu()

    def per_latent(self) -> dict[str, Tensor]:
        """``precision``, ``recall``, ``f1_score`` and ``accuracy`` per latent ``[X]`` (0 where undefined)."""
        tp, fp, fn, tn = self.tp, self.fp, self.fn, self.tn
        zeros = torch.zeros_like(tp)
        precision = torch.where(tp + fp > 0, tp / (tp + fp), zeros)
        recall = torch.where(tp + fn > 0, tp / (tp + fn), zeros)
        f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall), zeros)
        accuracy = (tp + tn) / (tp + fp + fn + tn).clamp(min=1e-8)
        return {"precision": precision, "recall": recall, "f1_score": f1, "accuracy": accuracy}

    def compute(self) -> ClassificationMetrics:
        """The means over latents."""
        if self.num_sae_latents == 0:
            return ClassificationMetrics(precision=0.0, recall=0.0, f1_score=0.0, accuracy=0.0)
        return ClassificationMetrics(**{name: value.mean().item() for name, value in self.per_latent().items()})


@dataclass
class SyntheticDataEvalResult:
    """SAELens's result fields; ``per_latent`` (ours) holds the per-latent classification tensors."""

    true_l0: float
    sae_l0: float
    dead_latents: int
    shrinkage: float
    explained_variance: float
    mcc: float
    uniqueness: float
    classification: ClassificationMetrics

    def to_log_dict(self, prefix: str = "") -> dict[str, float]:
        """One flat dictionary, ``classification/…`` keys for the classification means."""
        out: dict[str, float] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, ClassificationMetrics):
                out.update({f"{prefix}classification/{k}": v for k, v in asdict(value).items()})
            else:
                out[f"{prefix}{field.name}"] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values."""
        return {**asdict(self), "classification": asdict(self.classification)}


@torch.no_grad()
def eval_sae_on_synthetic_data(sae, feature_dict: FeatureDictionary, activations_generator: ActivationGenerator,
                               num_samples: int = 100_000, batch_size: Optional[int] = None,
                               activation_scaler=None) -> SyntheticDataEvalResult:
    """Scores ``sae`` (a ``wb.SAE``, or anything with ``encode``, ``decode`` and ``W_dec [X, D]``) on ``num_samples``
    samples drawn ``batch_size`` at a time. ``activation_scaler``: optional ``scale`` / ``unscale`` around the SAE.
    The result's ``per_latent`` attribute holds each latent's precision, recall, F1 and accuracy ``[X]``.

    Example:
        >>> fd = FeatureDictionary(4, 4, initializer=None, seed=0)
        >>> sae = perfect_sae(fd)
        >>> result = eval_sae_on_synthetic_data(sae, fd, ActivationGenerator(4, 0.5), num_samples=64)
        >>> round(result.mcc, 4), round(result.explained_variance, 4), result.uniqueness
        (1.0, 1.0, 1.0)
    """
    if num_samples < 1 or (batch_size is not None and batch_size < 1):
        raise InputError(f"num_samples and batch_size must be positive; got {num_samples} and {batch_size}")
    decoder, gt_features = sae.W_dec, feature_dict.feature_vectors
    if decoder.shape[-1] != feature_dict.hidden_dim:
        raise InputError(f"the SAE decodes to {decoder.shape[-1]} dimensions; the feature dictionary's hidden "
                         f"dimension is {feature_dict.hidden_dim}")
    if activations_generator.num_features != feature_dict.num_features:
        raise InputError(f"the generator has {activations_generator.num_features} features; the dictionary has "
                         f"{feature_dict.num_features}")
    if hasattr(sae, "eval"):
        sae.eval()
    batch_size = batch_size or num_samples
    true_l0 = sae_l0 = shrinkage = sum_sq = sum_residual = 0.0
    shrinkage_count, sum_x = 0, torch.zeros(feature_dict.hidden_dim, dtype=torch.float64)
    ever_fired = torch.zeros(decoder.shape[0], dtype=torch.bool)
    classification = ClassificationMetricsCalculator(decoder, gt_features)
    done = 0
    while done < num_samples:
        size = min(batch_size, num_samples - done)
        feature_acts = activations_generator.sample(size)
        hidden = feature_dict(feature_acts)
        scaled = activation_scaler.scale(hidden) if activation_scaler is not None else hidden
        latents = sae.encode(scaled)
        output = sae.decode(latents)
        output = activation_scaler.unscale(output) if activation_scaler is not None else output
        true_l0 += (feature_acts != 0).float().sum().item()
        sae_l0 += (latents != 0).float().sum().item()
        ever_fired |= (latents != 0).any(dim=0).cpu()
        norms = hidden.norm(dim=-1)
        valid = norms > 1e-6  # shrinkage is undefined at a zero input
        if valid.any():
            shrinkage += (output.norm(dim=-1)[valid] / norms[valid]).sum().item()
            shrinkage_count += int(valid.sum().item())
        promoted = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
        sum_x += promoted.sum(dim=0).to(device="cpu", dtype=torch.float64)
        sum_sq += promoted.pow(2).sum().item()
        sum_residual += (promoted - output).pow(2).sum().item()
        classification.add_batch(latents, feature_acts)
        done += size
    result = SyntheticDataEvalResult(
        true_l0=true_l0 / num_samples, sae_l0=sae_l0 / num_samples, dead_latents=int((~ever_fired).sum().item()),
        shrinkage=shrinkage / shrinkage_count if shrinkage_count else 0.0,
        explained_variance=_explained_variance(sum_x, sum_sq, sum_residual, num_samples),
        mcc=mean_correlation_coefficient(decoder, gt_features), uniqueness=feature_uniqueness(decoder, gt_features),
        classification=classification.compute())
    result.per_latent = classification.per_latent()
    return result


def _explained_variance(sum_x: Tensor, sum_sq: float, sum_residual: float, count: int) -> float:
    """``1 - E|x - x_hat|^2 / (E|x|^2 - |E x|^2)`` (SAELens's ``ExplainedVarianceCalculator``)."""
    total_variance = sum_sq / count - (sum_x / count).pow(2).sum().item()
    mse = sum_residual / count
    if total_variance < 1e-10:
        return 1.0 if mse < 1e-10 else 0.0
    return 1 - mse / total_variance


def perfect_sae(feature_dict: FeatureDictionary, dtype: torch.dtype = torch.float32):
    """A ``wb.SAE`` (standard ReLU) whose decoder is the true features and whose encoder their pseudo-inverse (an
    exact reconstruction when the features are linearly independent): the reference point of the metrics.

    Example:
        >>> perfect_sae(FeatureDictionary(3, 4, initializer=None, seed=0)).W_dec.shape
        torch.Size([3, 4])
    """
    vectors = feature_dict.feature_vectors.detach().to(dtype)
    cfg = SAEConfig("standard", d_in=feature_dict.hidden_dim, d_sae=feature_dict.num_features,
                    dtype=str(dtype).removeprefix("torch."))
    tensors = {"W_enc": torch.linalg.pinv(vectors), "b_enc": torch.zeros(feature_dict.num_features, dtype=dtype),
               "W_dec": vectors.clone(), "b_dec": feature_dict.bias.detach().to(dtype).clone()}
    return SAE.from_tensors(cfg, tensors)
