"""Fitting linear probes: L2-regularised logistic regression and the mass-mean (difference of means) probe.

Legend: N flattened tokens, i d_in, Y classes.

``fit_logistic`` minimises scikit-learn's ``LogisticRegression`` objective (``penalty="l2"``, the bias not
penalised): ``0.5 * |W|^2 + C * sum_n CE(x_n W^T + b, y_n)``, with one logit for two classes and a softmax over
all classes for more (scikit-learn's multinomial form), by L-BFGS in float64 until the gradient vanishes. So
SAEBench's sparse probing (scikit-learn with its default ``C=1.0``) and a user's own scikit-learn probes read
the same here. ``fit_mass_mean`` is Marks & Tegmark's probe: the direction from one class's mean to the
other's, thresholded half-way, optionally whitened by the pooled covariance (their iid variant).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from jaxtyping import Float, Int
from torch import Tensor

from workbench.errors import InputError


@dataclass(frozen=True)
class LinearProbe:
    """A fitted linear probe: ``decision(x) = x @ weight.T + bias``, one row per class (one row for two classes).

    ``classes`` are the label values in the order of ``predict_proba``'s columns.

    >>> X = torch.tensor([[0.0], [1.0], [3.0], [4.0]]); y = torch.tensor([0, 0, 1, 1])
    >>> probe = fit_mass_mean(X, y)
    >>> probe.predict(torch.tensor([[0.5], [3.5]])).tolist()
    [0, 1]
    """

    weight: Float[Tensor, "Y i"]
    bias: Float[Tensor, "Y"]
    classes: tuple[int, ...]

    def decision(self, x_Ni: Float[Tensor, "N i"]) -> Float[Tensor, "N Y"]:
        """The probe's logits (one column for two classes: the log-odds of the second class).

        >>> LinearProbe(torch.ones(1, 2), torch.zeros(1), (0, 1)).decision(torch.ones(3, 2)).shape
        torch.Size([3, 1])
        """
        x_Ni = _checked_rows(x_Ni, self.weight.shape[1])
        return x_Ni.to(self.weight.dtype) @ self.weight.T + self.bias

    def predict_proba(self, x_Ni: Float[Tensor, "N i"]) -> Float[Tensor, "N Y"]:
        """Each class's probability (columns in ``classes`` order).

        >>> LinearProbe(torch.ones(1, 1), torch.zeros(1), (0, 1)).predict_proba(torch.zeros(1, 1)).tolist()
        [[0.5, 0.5]]
        """
        logits_NY = self.decision(x_Ni)
        if logits_NY.shape[1] == 1:
            p_N1 = torch.sigmoid(logits_NY)
            return torch.cat([1 - p_N1, p_N1], dim=1)
        return torch.softmax(logits_NY, dim=1)

    def score(self, x_Ni: Float[Tensor, "N i"]) -> Float[Tensor, "N"]:
        """A two-class probe's score for the second class (its log-odds), what AUROC and a monitor read.

        >>> LinearProbe(torch.ones(1, 1), torch.zeros(1), (0, 1)).score(torch.tensor([[2.0]])).tolist()
        [2.0]
        """
        if len(self.classes) != 2:
            raise InputError(f"score() is the log-odds of a two-class probe; this probe has {len(self.classes)} "
                             "classes (use decision() or predict_proba())")
        return self.decision(x_Ni)[:, 0]

    def predict(self, x_Ni: Float[Tensor, "N i"]) -> Int[Tensor, "N"]:
        """The predicted label of each row (a value of ``classes``).

        >>> LinearProbe(torch.ones(1, 1), torch.zeros(1), (3, 7)).predict(torch.tensor([[-1.0], [1.0]])).tolist()
        [3, 7]
        """
        logits_NY = self.decision(x_Ni)
        index_N = (logits_NY[:, 0] > 0).long() if logits_NY.shape[1] == 1 else logits_NY.argmax(dim=1)
        return torch.tensor(self.classes, dtype=torch.long)[index_N]


def fit_logistic(x_Ni: Float[Tensor, "N i"], labels_N: Int[Tensor, "N"], C: float = 1.0,
                 max_iter: int = 500, tolerance: float = 1e-7) -> LinearProbe:
    """L2-regularised logistic regression with scikit-learn's objective and its ``C`` (inverse strength).

    Deterministic (L-BFGS from zero weights, float64), so no seed is needed; a probe's spread over seeds
    comes from the data split. The fitted probe is returned in float32.

    >>> X = torch.tensor([[-2.0], [-1.0], [1.0], [2.0]]); y = torch.tensor([0, 0, 1, 1])
    >>> probe = fit_logistic(X, y, C=10.0)
    >>> probe.predict(X).tolist(), bool(probe.weight[0, 0] > 0)
    ([0, 0, 1, 1], True)
    """
    if not C > 0:
        raise InputError(f"C must be positive (it is scikit-learn's inverse regularisation strength), got {C}")
    x_Ni, classes, index_N = _checked_data(x_Ni, labels_N)
    x_Ni = x_Ni.double()
    n_outputs = 1 if len(classes) == 2 else len(classes)
    weight_Yi = torch.zeros(n_outputs, x_Ni.shape[1], dtype=torch.float64, requires_grad=True)
    bias_Y = torch.zeros(n_outputs, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight_Yi, bias_Y], lr=1.0, max_iter=max_iter, tolerance_grad=tolerance,
                                  tolerance_change=tolerance * 1e-3, history_size=20, line_search_fn="strong_wolfe")

    def objective() -> Tensor:
        optimizer.zero_grad()
        loss = 0.5 * weight_Yi.pow(2).sum() + C * _summed_cross_entropy(x_Ni @ weight_Yi.T + bias_Y, index_N)
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(objective)
    return LinearProbe(weight_Yi.detach().float(), bias_Y.detach().float(), classes)


def fit_mass_mean(x_Ni: Float[Tensor, "N i"], labels_N: Int[Tensor, "N"], whiten: bool = False,
                  ridge: float = 1e-4) -> LinearProbe:
    """The mass-mean probe of two classes: direction ``mean(second) - mean(first)``, threshold half-way.

    ``whiten=True`` is the iid variant: the direction multiplied by the inverse of the pooled within-class
    covariance (plus ``ridge`` times its mean variance, so a rank-deficient covariance still inverts).

    >>> X = torch.tensor([[0.0, 5.0], [2.0, 5.0], [4.0, 5.0], [6.0, 5.0]]); y = torch.tensor([0, 0, 1, 1])
    >>> probe = fit_mass_mean(X, y)
    >>> probe.weight.tolist(), probe.bias.tolist()
    ([[4.0, 0.0]], [-12.0])
    """
    x_Ni, classes, index_N = _checked_data(x_Ni, labels_N)
    if len(classes) != 2:
        raise InputError(f"a mass-mean probe separates two classes; the labels hold {len(classes)}: {classes}")
    x_Ni = x_Ni.double()
    mean_first_i, mean_second_i = x_Ni[index_N == 0].mean(0), x_Ni[index_N == 1].mean(0)
    direction_i = mean_second_i - mean_first_i
    if whiten:
        centred_Ni = torch.where((index_N == 0)[:, None], x_Ni - mean_first_i, x_Ni - mean_second_i)
        covariance_ii = centred_Ni.T @ centred_Ni / max(len(x_Ni) - 2, 1)
        scale = ridge * covariance_ii.diagonal().mean().clamp_min(1e-12)
        direction_i = torch.linalg.solve(covariance_ii + scale * torch.eye(len(direction_i), dtype=x_Ni.dtype),
                                         direction_i)
    bias = -direction_i @ (mean_first_i + mean_second_i) / 2
    return LinearProbe(direction_i[None].float(), bias.reshape(1).float(), classes)


def _summed_cross_entropy(logits_NY: Tensor, index_N: Tensor) -> Tensor:
    if logits_NY.shape[1] == 1:
        return torch.nn.functional.binary_cross_entropy_with_logits(logits_NY[:, 0], index_N.to(logits_NY.dtype),
                                                                    reduction="sum")
    return torch.nn.functional.cross_entropy(logits_NY, index_N, reduction="sum")


def _checked_rows(x_Ni: Tensor, d_in: Optional[int]) -> Tensor:
    if not isinstance(x_Ni, Tensor) or x_Ni.ndim != 2:
        raise InputError(f"probe inputs must be a [rows, d_in] tensor, got {getattr(x_Ni, 'shape', type(x_Ni))}")
    if d_in is not None and x_Ni.shape[1] != d_in:
        raise InputError(f"probe inputs have width {x_Ni.shape[1]}, the probe was fitted on width {d_in}")
    if not torch.is_floating_point(x_Ni) or not torch.isfinite(x_Ni).all():
        raise InputError("probe inputs must be finite floating-point values")
    return x_Ni


def _checked_data(x_Ni: Tensor, labels_N: Tensor) -> tuple[Tensor, tuple[int, ...], Tensor]:
    """The inputs checked, the sorted label values, and each row's index into them."""
    x_Ni = _checked_rows(x_Ni, x_Ni.shape[1] if isinstance(x_Ni, Tensor) and x_Ni.ndim == 2 else None)
    labels_N = torch.as_tensor(labels_N)
    if labels_N.ndim != 1 or len(labels_N) != len(x_Ni) or torch.is_floating_point(labels_N):
        raise InputError(f"labels must be {len(x_Ni)} integers, one per input row, got shape "
                         f"{tuple(labels_N.shape)} of {labels_N.dtype}")
    classes, index_N = torch.unique(labels_N, sorted=True, return_inverse=True)
    if len(classes) < 2:
        raise InputError(f"a probe needs at least two classes; every label is {labels_N[0].item() if len(labels_N) else 'missing'}")
    return x_Ni, tuple(int(c) for c in classes.tolist()), index_N
