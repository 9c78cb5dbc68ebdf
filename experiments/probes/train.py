"""Probes per hook point over a labelled dataset: activations read once, one probe per hook, held-out scores.

Legend: B batch, P position, N flattened tokens, D d_model, i d_in.

``probe_activations`` runs the model once per batch of texts up to the deepest hook asked for and keeps one
row per text at each hook (its last real token, or the mean over its real tokens; ``experiments._hook_rows``). ``train_probe`` fits a
probe per hook on a stratified split for each seed (the split is what a seed changes: the fits themselves are
deterministic) and tabulates held-out accuracy and AUROC with their spread; the probes it returns are fitted on
the first seed's training rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence, Union

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from experiments._hook_rows import hook_rows
from experiments._progress import ProgressArg
from experiments.probes.fit import LinearProbe, fit_logistic, fit_mass_mean
from experiments.probes.scores import accuracy, auroc, stratified_split
from workbench.errors import InputError

ProbeKind = Literal["logistic", "mass_mean"]
Reading = Literal["last", "mean"]


@dataclass(frozen=True)
class ProbeRun:
    """What ``train_probe`` returns: a probe per hook (first seed's split) and the held-out table.

    ``table`` has one row per hook: ``hook_name``, ``layer``, ``accuracy`` and ``accuracy_std``, ``auroc`` and
    ``auroc_std`` (NaN for more than two classes), ``n_train``, ``n_test``, ``seeds``.
    """

    probes: dict[str, LinearProbe]
    table: pd.DataFrame


def probe_activations(model, texts: Sequence[str], hook_names: Sequence[str], reading: Reading = "last",
                      batch_size: int = 16, progress: ProgressArg = True) -> dict[str, Float[Tensor, "N i"]]:
    """One activation row per text at each hook: its last real token (``"last"``) or the mean of its real tokens.

    Only the blocks up to the deepest hook run; texts are padded on the right within a batch.

    >>> acts = probe_activations(model, ["import os", "def f(x):"], ["blocks.0.hook_resid_post"], progress=False)
    >>> acts["blocks.0.hook_resid_post"].shape
    torch.Size([2, 128])
    """
    hook_names = _checked_hooks(model, hook_names)
    if reading not in ("last", "mean"):
        raise InputError(f"reading must be 'last' or 'mean', got {reading!r}")
    if isinstance(texts, str) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise InputError("texts must be a non-empty list of non-empty strings")
    return hook_rows(model, list(texts), hook_names, reading, batch_size, progress, desc="probe activations")


def train_probe(model, texts: Sequence[str], labels: Union[Sequence[int], Tensor], hook_names: Sequence[str],
                kind: ProbeKind = "logistic", reading: Reading = "last", test_fraction: float = 0.2,
                seeds: Sequence[int] = (0, 1, 2), C: float = 1.0, whiten: bool = False, batch_size: int = 16,
                progress: ProgressArg = True) -> ProbeRun:
    """Logistic or mass-mean probes at each hook over labelled texts, scored on held-out rows over seeds.

    ``C`` is the logistic probe's inverse regularisation (scikit-learn's); ``whiten`` the mass-mean probe's
    iid variant (its direction through the inverse within-class covariance), which reads a direction that is
    not the activations' own principal one.

    >>> texts = ["import os", "def f(x):", "x = 1", "the cat sat", "a dog ran", "we like tea"] * 2
    >>> run = train_probe(model, texts, [0, 0, 0, 1, 1, 1] * 2, ["blocks.0.hook_resid_post"],
    ...                   test_fraction=0.5, progress=False)
    >>> list(run.table.columns[:4]), sorted(run.probes)
    (['hook_name', 'layer', 'accuracy', 'accuracy_std'], ['blocks.0.hook_resid_post'])
    """
    labels_N = torch.as_tensor(labels)
    if labels_N.ndim != 1 or len(labels_N) != len(texts):
        raise InputError(f"labels must give one class per text: {len(texts)} texts, labels of shape "
                         f"{tuple(labels_N.shape)}")
    if len(torch.unique(labels_N)) < 2:
        raise InputError("the labels hold one class only; a probe needs at least two")
    if kind not in ("logistic", "mass_mean"):
        raise InputError(f"kind must be 'logistic' or 'mass_mean', got {kind!r}")
    seeds = tuple(int(s) for s in seeds)
    if not seeds:
        raise InputError("seeds must name at least one seed")
    splits = [stratified_split(labels_N, test_fraction, seed) for seed in seeds]
    activations = probe_activations(model, texts, hook_names, reading, batch_size, progress)
    fit = (lambda x, y: fit_logistic(x, y, C=C)) if kind == "logistic" else \
        (lambda x, y: fit_mass_mean(x, y, whiten=whiten))
    probes, records = {}, []
    for name, x_Ni in activations.items():
        probes[name], scores, _ = held_out_scores(x_Ni, labels_N, splits, fit)
        records.append({"hook_name": name, "layer": model.layer_of(name), **scores,
                        "n_train": len(splits[0][0]), "n_test": len(splits[0][1]), "seeds": len(seeds)})
    table = pd.DataFrame.from_records(records)
    table["layer"] = table["layer"].astype("Int64")  # hooks outside the blocks have none
    return ProbeRun(probes, table)


def held_out_scores(x_Ni: Float[Tensor, "N i"], labels_N: Tensor, splits: Sequence[tuple[Tensor, Tensor]],
                    fit: Callable[[Tensor, Tensor], LinearProbe],
                    select: Optional[Callable[[Tensor], Tensor]] = None) -> tuple[LinearProbe, dict[str, float], Tensor]:
    """A probe fitted on each split's training rows and scored on its test rows: the first split's probe, the
    scores (``accuracy`` / ``auroc``, the mean over splits, with their sample standard deviation ``*_std``; AUROC NaN
    unless the probe and the test rows have two classes), and the first split's columns. ``select(train_rows)``
    chooses the columns a split's probe reads (all by default), on its own training rows. The one scoring loop
    every probe table uses.

    Example:
        >>> x = torch.tensor([[0.0], [1.0], [2.0], [3.0], [10.0], [11.0], [12.0], [13.0]])
        >>> y = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
        >>> _, scores, _ = held_out_scores(x, y, [stratified_split(y, 0.5, seed) for seed in (0, 1)], fit_mass_mean)
        >>> scores["accuracy"], scores["accuracy_std"], scores["auroc"]
        (1.0, 0.0, 1.0)
    """
    firsts, accuracies, areas = [], [], []
    for train, test in splits:
        columns = torch.arange(x_Ni.shape[1]) if select is None else select(train)
        probe = fit(x_Ni[train][:, columns], labels_N[train])
        firsts = firsts or [probe, columns]
        accuracies.append(accuracy(probe.predict(x_Ni[test][:, columns]), labels_N[test]))
        two_classes = len(probe.classes) == 2 and len(torch.unique(labels_N[test])) == 2
        areas.append(auroc(probe.score(x_Ni[test][:, columns]), labels_N[test]) if two_classes else float("nan"))
    acc, area = torch.tensor(accuracies, dtype=torch.float64), torch.tensor(areas, dtype=torch.float64)
    spread = (lambda values: values.std(unbiased=True).item() if len(values) > 1 else 0.0)
    scores = {"accuracy": acc.mean().item(), "accuracy_std": spread(acc), "auroc": area.mean().item(),
              "auroc_std": spread(area)}
    return firsts[0], scores, firsts[1]


def _checked_hooks(model, hook_names: Sequence[str]) -> list[str]:
    if isinstance(hook_names, str):
        hook_names = [hook_names]
    hook_names = list(hook_names)
    if not hook_names:
        raise InputError("hook_names must name at least one hook point")
    model.check_hook_names(hook_names)
    return hook_names
