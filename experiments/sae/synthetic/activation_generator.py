"""``ActivationGenerator``: sparse ground-truth feature activations with controlled firing, magnitudes, correlation
and hierarchy.

SAELens 6.54's ``sae_lens.synthetic.activation_generator``: the same torch random calls in the same order (Bernoulli
firing, or a Gaussian copula thresholded at ``sqrt(2) erfinv(1 - 2p)`` when a correlation is given; then one normal
draw per firing for its magnitude, ``relu(mean + std * z)``; then the modifiers, then a ReLU), so the same global
seed gives the same samples.

Legend: B batch.
``num_features`` in shapes is the number of ground-truth features, ``rank`` a low-rank correlation's rank.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor, nn
from torch.distributions import MultivariateNormal

from experiments.sae.synthetic.correlation import LowRankCorrelationMatrix
from workbench.errors import InputError

ActivationsModifier = Callable[..., Tensor]  # (acts) -> acts, or (acts, generator) -> acts
ActivationsModifierInput = Union[ActivationsModifier, Sequence[ActivationsModifier], None]
CorrelationMatrixInput = Union[Tensor, LowRankCorrelationMatrix, tuple]


class ActivationGenerator(nn.Module):
    """Samples ``[B, num_features]`` non-negative feature activations (SAELens's knobs and defaults).

    ``firing_probabilities``: a float or ``[num_features]`` (for example ``zipfian_firing_probabilities``);
    ``std_firing_magnitudes`` (default 0) and ``mean_firing_magnitudes`` (default 1): floats or ``[num_features]``;
    ``modify_activations``: a callable or a list applied in order (``hierarchy_modifier``'s result);
    ``correlation_matrix``: a full ``[num_features, num_features]`` correlation, a ``LowRankCorrelationMatrix`` or
    ``(factor, diag)``;
    ``use_sparse_tensors``: ``sample`` returns a sparse COO tensor.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> generator = ActivationGenerator(4, firing_probabilities=0.5, mean_firing_magnitudes=2.0)
        >>> acts = generator.sample(1000)
        >>> acts.shape, sorted(acts.unique().tolist()), round(float((acts > 0).float().mean()), 1)
        (torch.Size([1000, 4]), [0.0, 2.0], 0.5)
    """

    def __init__(self, num_features: int, firing_probabilities: Union[Tensor, float],
                 std_firing_magnitudes: Union[Tensor, float] = 0.0, mean_firing_magnitudes: Union[Tensor, float] = 1.0,
                 modify_activations: ActivationsModifierInput = None,
                 correlation_matrix: Optional[CorrelationMatrixInput] = None, device: Union[torch.device, str] = "cpu",
                 dtype: Union[torch.dtype, str] = "float32", use_sparse_tensors: bool = False):
        super().__init__()
        self.num_features = num_features
        self.firing_probabilities = _to_tensor(firing_probabilities, num_features, device, dtype,
                                               "firing_probabilities")
        self.std_firing_magnitudes = _to_tensor(std_firing_magnitudes, num_features, device, dtype,
                                                "std_firing_magnitudes")
        self.mean_firing_magnitudes = _to_tensor(mean_firing_magnitudes, num_features, device, dtype,
                                                 "mean_firing_magnitudes")
        self.modify_activations = _normalize_modifiers(modify_activations)
        self.correlation_thresholds: Optional[Tensor] = None
        self.correlation_matrix: Optional[Tensor] = None
        self.low_rank_correlation: Optional[tuple[Tensor, Tensor]] = None
        self.use_sparse_tensors = use_sparse_tensors
        if correlation_matrix is not None:
            if isinstance(correlation_matrix, Tensor):
                _validate_correlation_matrix(correlation_matrix, num_features)
                self.correlation_matrix = correlation_matrix
            else:
                factor, diag = correlation_matrix[0], correlation_matrix[1]
                _validate_low_rank_correlation(factor, diag, num_features)
                self.low_rank_correlation = (factor, diag.sqrt())
            # the inverse normal CDF: a standard normal exceeds this with probability p
            self.correlation_thresholds = math.sqrt(2) * torch.erfinv(1 - 2 * self.firing_probabilities)

    @torch.no_grad()
    def sample(self, batch_size: int) -> Float[Tensor, "B num_features"]:
        """A batch of feature activations (dense, or sparse COO with ``use_sparse_tensors``).

        Example:
            >>> _ = torch.manual_seed(0)
            >>> ActivationGenerator(3, torch.tensor([1.0, 0.0, 1.0])).sample(2)
            tensor([[1., 0., 1.],
                    [1., 0., 1.]])
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive integer; got {batch_size!r}")
        device = self.firing_probabilities.device
        if self.correlation_matrix is not None:
            firing = _correlated_firing(batch_size, self.correlation_matrix, self.correlation_thresholds, device)
        elif self.low_rank_correlation is not None:
            firing = _low_rank_correlated_firing(batch_size, *self.low_rank_correlation, self.correlation_thresholds,
                                                 device)
        else:
            firing = torch.bernoulli(self.firing_probabilities.unsqueeze(0).expand(batch_size, -1)).nonzero(
                as_tuple=True)
        features = firing[1]
        dtype = self.mean_firing_magnitudes.dtype
        deltas = torch.randn(features.shape[0], device=device, dtype=dtype) * self.std_firing_magnitudes[features]
        values = (self.mean_firing_magnitudes[features] + deltas).relu()
        if self.use_sparse_tensors:
            acts = torch.sparse_coo_tensor(torch.stack(firing), values, size=(batch_size, self.num_features),
                                           device=device, dtype=dtype)
        else:
            acts = torch.zeros(batch_size, self.num_features, device=device, dtype=dtype)
            acts[firing] = values
        if self.modify_activations is not None:
            acts = self.modify_activations(acts, self)
            if acts.is_sparse:
                acts = acts.coalesce()
                acts = torch.sparse_coo_tensor(acts.indices(), acts.values().relu(), acts.shape, device=acts.device,
                                               dtype=acts.dtype)
            else:
                acts = acts.relu()
        return acts

    def forward(self, batch_size: int) -> Float[Tensor, "B num_features"]:
        """``sample(batch_size)``.

        Example:
            >>> ActivationGenerator(2, 1.0)(1)
            tensor([[1., 1.]])
        """
        return self.sample(batch_size)


def _correlated_firing(batch_size: int, correlation: Tensor, thresholds: Tensor, device) -> tuple[Tensor, Tensor]:
    """Gaussian copula: which features fire, from a full correlation matrix."""
    mvn = MultivariateNormal(loc=torch.zeros(correlation.shape[0], device=device, dtype=thresholds.dtype),
                             covariance_matrix=correlation.to(device=device, dtype=thresholds.dtype))
    rows, cols = (mvn.sample((batch_size,)) > thresholds.unsqueeze(0)).nonzero(as_tuple=True)
    return rows, cols


def _low_rank_correlated_firing(batch_size: int, factor: Float[Tensor, "num_features rank"],
                                diag_sqrt: Float[Tensor, "num_features"],
                                thresholds: Tensor, device) -> tuple[Tensor, Tensor]:
    """Gaussian copula with covariance ``factor factor^T + diag``: ``eps factor^T + eta sqrt(diag)``."""
    eps = torch.randn(batch_size, factor.shape[1], device=device, dtype=factor.dtype)
    eta = torch.randn(batch_size, factor.shape[0], device=device, dtype=diag_sqrt.dtype)
    rows, cols = (eps @ factor.T + eta * diag_sqrt > thresholds.unsqueeze(0)).nonzero(as_tuple=True)
    return rows, cols


def _to_tensor(value: Union[Tensor, float], num_features: int, device, dtype, name: str) -> Tensor:
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(value, Tensor):
        value = value * torch.ones(num_features, device=torch.device(device), dtype=dtype)
    if value.shape != (num_features,):
        raise InputError(f"{name} must be a float or a tensor of shape ({num_features},); got {tuple(value.shape)}")
    return value.to(torch.device(device), dtype)


class _ModifierWrapper:
    """A one- or two-argument modifier called as ``(acts, generator)``."""

    def __init__(self, fn: ActivationsModifier):
        self._fn = fn
        self._takes_generator = len(inspect.signature(fn).parameters) >= 2

    def __call__(self, activations: Tensor, generator: ActivationGenerator) -> Tensor:
        return self._fn(activations, generator) if self._takes_generator else self._fn(activations)


def _normalize_modifiers(modifiers: ActivationsModifierInput) -> Optional[_ModifierWrapper]:
    if modifiers is None:
        return None
    if callable(modifiers):
        return modifiers if isinstance(modifiers, _ModifierWrapper) else _ModifierWrapper(modifiers)
    wrappers = [_ModifierWrapper(m) for m in modifiers]
    if not wrappers:
        return None
    if len(wrappers) == 1:
        return wrappers[0]

    def chained(activations: Tensor, generator: ActivationGenerator) -> Tensor:
        for wrapper in wrappers:
            activations = wrapper(activations, generator)
        return activations

    return _ModifierWrapper(chained)


def _validate_correlation_matrix(matrix: Tensor, num_features: int) -> None:
    if matrix.shape != (num_features, num_features):
        raise InputError(f"correlation matrix must have shape ({num_features}, {num_features}); got "
                         f"{tuple(matrix.shape)}")
    if not torch.allclose(torch.diag(matrix), torch.ones(num_features, dtype=matrix.dtype, device=matrix.device)):
        raise InputError("correlation matrix diagonal must be all 1s")
    if torch.linalg.cholesky_ex(matrix).info.item() != 0:
        raise InputError("correlation matrix must be positive definite")


def _validate_low_rank_correlation(factor: Tensor, diag: Tensor, num_features: int) -> None:
    if factor.ndim != 2 or factor.shape[0] != num_features:
        raise InputError(f"correlation_factor must have shape ({num_features}, rank); got {tuple(factor.shape)}")
    if diag.shape != (num_features,):
        raise InputError(f"correlation_diag must have shape ({num_features},); got {tuple(diag.shape)}")
    if torch.any(diag <= 0):
        raise InputError("correlation_diag must have all positive values")
