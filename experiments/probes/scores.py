"""Scores of a probe on held-out rows (accuracy, AUROC) and the stratified split that holds them out.

Legend: N flattened tokens.

AUROC is the probability that a random positive row scores above a random negative one, ties counting
half (the Mann-Whitney U statistic over the product of the class sizes), the same number as scikit-learn's
``roc_auc_score`` for two classes.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from workbench.errors import InputError


def accuracy(predicted_N: Int[Tensor, "N"], labels_N: Int[Tensor, "N"]) -> float:
    """The fraction of rows whose prediction equals the label.

    >>> accuracy(torch.tensor([0, 1, 1, 0]), torch.tensor([0, 1, 0, 0]))
    0.75
    """
    predicted_N, labels_N = torch.as_tensor(predicted_N), torch.as_tensor(labels_N)
    if predicted_N.shape != labels_N.shape or predicted_N.ndim != 1 or len(labels_N) == 0:
        raise InputError(f"accuracy needs two equal non-empty 1-D label tensors, got {tuple(predicted_N.shape)} "
                         f"and {tuple(labels_N.shape)}")
    return (predicted_N == labels_N).double().mean().item()


def auroc(scores_N: Float[Tensor, "N"], labels_N: Int[Tensor, "N"]) -> float:
    """Area under the ROC curve of two-class scores (label 1, or the larger label, is the positive class).

    >>> auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
    0.75
    """
    scores_N, labels_N = torch.as_tensor(scores_N).double(), torch.as_tensor(labels_N)
    if scores_N.shape != labels_N.shape or scores_N.ndim != 1:
        raise InputError(f"auroc needs scores and labels of one shape, got {tuple(scores_N.shape)} and "
                         f"{tuple(labels_N.shape)}")
    classes = torch.unique(labels_N)
    if len(classes) != 2:
        raise InputError(f"auroc needs exactly two classes among the labels, found {len(classes)}")
    positive_N = labels_N == classes[1]
    # Average ranks (ties share the mean of their ranks) give the Mann-Whitney U in one sort.
    order_N = torch.argsort(scores_N)
    sorted_N = scores_N[order_N]
    ranks_N = torch.empty_like(scores_N)
    ranks_N[order_N] = torch.arange(1, len(scores_N) + 1, dtype=torch.float64)
    unique_values, inverse_N = torch.unique(sorted_N, return_inverse=True)
    mean_rank = torch.zeros(len(unique_values), dtype=torch.float64).index_add_(
        0, inverse_N, torch.arange(1, len(scores_N) + 1, dtype=torch.float64))
    mean_rank /= torch.bincount(inverse_N).double()
    ranks_N[order_N] = mean_rank[inverse_N]
    n_positive, n_negative = int(positive_N.sum()), int((~positive_N).sum())
    u_statistic = ranks_N[positive_N].sum().item() - n_positive * (n_positive + 1) / 2
    return u_statistic / (n_positive * n_negative)


def stratified_split(labels_N: Int[Tensor, "N"], test_fraction: float = 0.2, seed: int = 0
                     ) -> tuple[Int[Tensor, "N"], Int[Tensor, "N"]]:
    """Row indices (train, test), each class split in the same proportion, shuffled by ``seed``.

    >>> train, test = stratified_split(torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1]), 0.5, seed=0)
    >>> len(train), len(test), sorted(torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])[test].tolist())
    (5, 5, [0, 0, 1, 1, 1])
    """
    labels_N = torch.as_tensor(labels_N)
    if not 0 < test_fraction < 1:
        raise InputError(f"test_fraction must be between 0 and 1, got {test_fraction}")
    generator = torch.Generator().manual_seed(int(seed))
    train, test = [], []
    for value in torch.unique(labels_N).tolist():
        rows = torch.nonzero(labels_N == value)[:, 0]
        if len(rows) < 2:
            raise InputError(f"class {value} has {len(rows)} row; a held-out split needs at least two per class")
        rows = rows[torch.randperm(len(rows), generator=generator)]
        n_test = min(max(1, round(len(rows) * test_fraction)), len(rows) - 1)
        test.append(rows[:n_test])
        train.append(rows[n_test:])
    return torch.sort(torch.cat(train)).values, torch.sort(torch.cat(test)).values
