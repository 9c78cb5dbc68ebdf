"""The probe fits and scores, checked against their definitions: the logistic objective's optimality
conditions, the mass-mean probe's closed form, AUROC as the share of correctly ordered pairs."""

import itertools

import pytest
import torch

from experiments.probes import accuracy, auroc, fit_logistic, fit_mass_mean, stratified_split
from workbench.errors import InputError


def _planted(n=300, d=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=generator)
    labels = (x[:, 2] + 0.5 * torch.randn(n, generator=generator) > 0).long()
    return x, labels


@pytest.mark.parametrize("C", [0.1, 1.0, 10.0])
def test_the_binary_logistic_fit_satisfies_the_regularised_objectives_optimality_conditions(C):
    x, labels = _planted()
    probe = fit_logistic(x, labels, C=C)
    weight, bias = probe.weight.double()[0], probe.bias.double()[0]
    residual = torch.sigmoid(x.double() @ weight + bias) - labels.double()
    # d/dW [0.5|W|^2 + C sum CE] = W + C X^T (p - y); d/db = C sum (p - y); both vanish at the optimum.
    assert (weight + C * x.double().T @ residual).abs().max() < 1e-3
    assert (C * residual.sum()).abs() < 1e-3


def test_the_multiclass_logistic_fit_is_the_multinomial_optimum():
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 3, (240,), generator=generator)
    x = torch.randn(240, 4, generator=generator) + 2 * torch.nn.functional.one_hot(labels, 4).float()
    probe = fit_logistic(x, labels, C=1.0)
    assert probe.weight.shape == (3, 4) and probe.classes == (0, 1, 2)
    residual = torch.softmax(x.double() @ probe.weight.double().T + probe.bias.double(), 1) \
        - torch.nn.functional.one_hot(labels, 3).double()
    assert (probe.weight.double() + x.double().T.matmul(residual).T).abs().max() < 1e-3
    assert accuracy(probe.predict(x), labels) > 0.8


def test_a_planted_linear_feature_is_read_at_high_held_out_accuracy():
    x, labels = _planted(n=600)
    train, test = stratified_split(labels, 0.25, seed=3)
    for probe in (fit_logistic(x[train], labels[train]), fit_mass_mean(x[train], labels[train], whiten=True)):
        assert accuracy(probe.predict(x[test]), labels[test]) >= 0.8
        assert auroc(probe.score(x[test]), labels[test]) >= 0.9


def test_the_mass_mean_probe_is_the_difference_of_means_thresholded_half_way():
    x = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 0.0], [7.0, 4.0]])
    labels = torch.tensor([3, 3, 8, 8])
    probe = fit_mass_mean(x, labels)
    # means (2, 1) and (6, 2): direction (4, 1), midpoint (4, 1.5), bias -(16 + 1.5).
    assert probe.weight.tolist() == [[4.0, 1.0]] and probe.bias.tolist() == [-17.5]
    assert probe.classes == (3, 8) and probe.predict(x).tolist() == [3, 3, 8, 8]


def test_auroc_is_the_share_of_positive_negative_pairs_in_order_ties_counting_half():
    generator = torch.Generator().manual_seed(2)
    scores = torch.randint(0, 5, (40,), generator=generator).float()
    labels = torch.randint(0, 2, (40,), generator=generator)
    pairs = list(itertools.product(scores[labels == 1].tolist(), scores[labels == 0].tolist()))
    expected = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)
    assert auroc(scores, labels) == pytest.approx(expected, abs=1e-12)


def test_the_split_keeps_each_class_in_both_parts_and_depends_on_the_seed():
    labels = torch.tensor([0] * 10 + [1] * 30)
    train, test = stratified_split(labels, 0.2, seed=0)
    assert sorted(torch.cat([train, test]).tolist()) == list(range(40))
    assert labels[test].tolist().count(0) == 2 and labels[test].tolist().count(1) == 6
    assert not torch.equal(test, stratified_split(labels, 0.2, seed=1)[1])


@pytest.mark.parametrize("call, message", [
    (lambda: fit_logistic(torch.randn(4, 2), torch.zeros(4, dtype=torch.long)), "two classes"),
    (lambda: fit_mass_mean(torch.randn(6, 2), torch.tensor([0, 1, 2, 0, 1, 2])), "two classes"),
    (lambda: fit_logistic(torch.randn(4, 2), torch.tensor([0, 1, 0])), "one per input row"),
    (lambda: fit_logistic(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]), C=0), "C must be positive"),
    (lambda: fit_logistic(torch.full((2, 2), float("nan")), torch.tensor([0, 1])), "finite"),
    (lambda: fit_mass_mean(torch.randn(4, 2), torch.tensor([0, 1, 0, 1])).predict(torch.randn(3, 5)), "width 5"),
    (lambda: auroc(torch.randn(3), torch.tensor([1, 1, 1])), "two classes"),
    (lambda: stratified_split(torch.tensor([0, 0, 1]), 0.5), "class 1 has 1 row"),
])
def test_bad_probe_input_gets_a_clear_error(call, message):
    with pytest.raises(InputError, match=message):
        call()
