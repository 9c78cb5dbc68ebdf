"""Feature correlations for ``ActivationGenerator``: full and low-rank correlation matrices (SAELens 6.54's
``sae_lens.synthetic.correlation``, the same torch random calls).

``num_features`` in shapes is the number of ground-truth features, ``rank`` the correlation's rank.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from jaxtyping import Float
from torch import Tensor

from workbench.errors import InputError


class LowRankCorrelationMatrix(NamedTuple):
    """``correlation = correlation_factor @ correlation_factor.T + diag(correlation_diag)``, held in
    ``O(num_features * rank)`` memory.

    Example:
        >>> LowRankCorrelationMatrix(torch.zeros(3, 1), torch.ones(3)).correlation_factor.shape
        torch.Size([3, 1])
    """

    correlation_factor: Float[Tensor, "num_features rank"]
    correlation_diag: Float[Tensor, "num_features"]


def create_correlation_matrix_from_correlations(num_features: int,
                                                correlations: Optional[dict[tuple[int, int], float]] = None,
                                                default_correlation: float = 0.0
                                                ) -> Float[Tensor, "num_features num_features"]:
    """A correlation matrix with the given pairwise values (made positive definite if they are not).

    Example:
        >>> create_correlation_matrix_from_correlations(2, {(0, 1): 0.5})
        tensor([[1.0000, 0.5000],
                [0.5000, 1.0000]])
    """
    matrix = torch.eye(num_features) + default_correlation * (1 - torch.eye(num_features))
    for (i, j), value in (correlations or {}).items():
        matrix[i, j] = value
        matrix[j, i] = value
    matrix = (matrix + matrix.T) / 2
    if torch.any(torch.linalg.eigvalsh(matrix) < -1e-6):
        matrix = _fix_correlation_matrix(matrix)
    return matrix


def _fix_correlation_matrix(matrix: Tensor, min_eigenval: float = 1e-6) -> Tensor:
    """Eigenvalues clamped, rescaled back to a unit diagonal."""
    eigenvals, eigenvecs = torch.linalg.eigh(matrix)
    fixed = eigenvecs @ torch.diag(eigenvals.clamp(min=min_eigenval)) @ eigenvecs.T
    diag = torch.diag(fixed).clamp(min=1e-8)
    fixed = fixed / torch.sqrt(diag.unsqueeze(0) * diag.unsqueeze(1))
    fixed.fill_diagonal_(1.0)
    return fixed


def generate_random_correlation_matrix(num_features: int, positive_ratio: float = 0.5, uncorrelated_ratio: float = 0.3,
                                       min_correlation_strength: float = 0.1, max_correlation_strength: float = 0.8,
                                       seed: Optional[int] = None, device: Union[torch.device, str] = "cpu",
                                       dtype: Union[torch.dtype, str] = torch.float32
                                       ) -> Float[Tensor, "num_features num_features"]:
    """A random correlation matrix: a pair is correlated with probability ``1 - uncorrelated_ratio``, positive with
    probability ``positive_ratio``, with a strength uniform in ``[min, max]``; made positive definite if needed.

    Example:
        >>> matrix = generate_random_correlation_matrix(5, seed=0)
        >>> matrix.shape, torch.allclose(matrix, matrix.T), torch.diag(matrix).tolist()
        (torch.Size([5, 5]), True, [1.0, 1.0, 1.0, 1.0, 1.0])
    """
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not (0 <= positive_ratio <= 1 and 0 <= uncorrelated_ratio <= 1
            and 0 <= min_correlation_strength <= max_correlation_strength <= 1):
        raise InputError("need 0 <= positive_ratio, uncorrelated_ratio <= 1 and 0 <= min_correlation_strength <= "
                         "max_correlation_strength <= 1")
    if num_features <= 1:
        return torch.eye(num_features, device=device, dtype=dtype)
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    rows, cols = torch.triu_indices(num_features, num_features, offset=1)
    pairs = rows.shape[0]
    correlated = torch.rand(pairs, generator=generator, device=device) >= uncorrelated_ratio
    signs = torch.where(torch.rand(pairs, generator=generator, device=device) < positive_ratio, 1.0, -1.0)
    strengths = (torch.rand(pairs, generator=generator, device=device, dtype=dtype)
                 * (max_correlation_strength - min_correlation_strength) + min_correlation_strength)
    values = correlated.to(dtype) * signs.to(dtype) * strengths
    matrix = torch.eye(num_features, device=device, dtype=dtype)
    matrix[rows, cols] = values
    matrix[cols, rows] = values
    if torch.any(torch.linalg.eigvalsh(matrix) < -1e-6):
        matrix = _fix_correlation_matrix(matrix)
    return matrix


def generate_random_low_rank_correlation_matrix(num_features: int, rank: int, correlation_scale: float = 0.075,
                                                seed: Optional[int] = None, device: Union[torch.device, str] = "cpu",
                                                dtype: Union[torch.dtype, str] = torch.float32
                                                ) -> LowRankCorrelationMatrix:
    """A random low-rank correlation: ``factor ~ N(0, correlation_scale^2)``, ``diag = 1 - |factor_i|^2`` (rows whose
    diagonal would fall under 0.01 are rescaled, as SAELens does).

    Example:
        >>> low_rank = generate_random_low_rank_correlation_matrix(6, rank=2, seed=0)
        >>> full = low_rank.correlation_factor @ low_rank.correlation_factor.T + torch.diag(low_rank.correlation_diag)
        >>> torch.allclose(torch.diag(full), torch.ones(6))
        True
    """
    min_diag = 0.01
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if rank <= 0:
        raise InputError(f"rank must be positive; got {rank}")
    if correlation_scale < 0:
        raise InputError(f"correlation_scale must be non-negative; got {correlation_scale}")
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    factor = torch.randn(num_features, rank, generator=generator, device=device, dtype=dtype) * correlation_scale
    squares = (factor ** 2).sum(dim=1)
    capped = (1 - squares) < min_diag
    factor[capped, :] *= torch.sqrt((1 - min_diag) / squares[capped].unsqueeze(1))
    return LowRankCorrelationMatrix(correlation_factor=factor, correlation_diag=1 - (factor ** 2).sum(dim=1))
