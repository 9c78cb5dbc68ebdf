"""Sparse probes on SAE latents: a probe that may read only the ``k`` latents whose class means differ most
(SAEBench's selection rule), beside a probe on the raw activation at the same hook.

Legend: N flattened tokens, i d_in, X d_sae.
"""

from __future__ import annotations

from typing import Sequence, Union

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from experiments._progress import ProgressArg
from experiments.probes.fit import fit_logistic
from experiments.probes.scores import stratified_split
from experiments.probes.train import Reading, held_out_scores, probe_activations
from workbench.errors import InputError


def top_k_mean_diff(x_Ni: Float[Tensor, "N i"], labels_N: Int[Tensor, "N"], k: int) -> Int[Tensor, "chosen"]:
    """The ``k`` columns whose mean over label-1 rows differs most (in absolute value) from the mean over label-0
    rows: SAEBench's rule for choosing a sparse probe's inputs (its ``get_top_k_mean_diff_mask``).

    Example:
        >>> x = torch.tensor([[0.0, 1.0, 5.0], [0.0, 3.0, 5.0], [2.0, 1.0, 0.0], [2.0, 3.0, 1.0]])
        >>> top_k_mean_diff(x, torch.tensor([0, 0, 1, 1]), 2).tolist()  # |diff| = 2, 0, 4.5
        [2, 0]
    """
    labels_N = torch.as_tensor(labels_N)
    difference = (x_Ni[labels_N == 1].float().mean(0) - x_Ni[labels_N == 0].float().mean(0)).abs()
    return torch.argsort(difference, descending=True, stable=True)[:k]


def sparse_probe(model, sae, texts: Sequence[str], labels: Union[Sequence[int], Tensor],
                 k_values: Sequence[int] = (1, 2, 5, 20), reading: Reading = "last", test_fraction: float = 0.2,
                 seeds: Sequence[int] = (0, 1, 2), C: float = 1.0, batch_size: int = 16,
                 progress: ProgressArg = True) -> pd.DataFrame:
    """Held-out accuracy and AUROC of two-class logistic probes on the top-``k`` SAE latents, for each k, and of one
    on the raw activation at the SAE's hook (``inputs`` "activation", ``k`` NaN), with their spread over seeds.

    The latents are the SAE's encoding of each text's activation (its last real token, or the mean of its real
    tokens); each seed's split chooses its own latents on its training rows. ``latents`` lists the first seed's.

    Example:
        >>> sae = wb.load_sae("toy-attn-2l-resid1-topk")
        >>> texts = ["import os", "def f(x):", "x = 1", "the cat sat", "a dog ran", "we like tea"] * 2
        >>> table = sparse_probe(model, sae, texts, [0, 0, 0, 1, 1, 1] * 2, k_values=(1, 2), test_fraction=0.5,
        ...                      progress=False)
        >>> table["inputs"].tolist(), table["k"].tolist()[:2]
        (['sae latents', 'sae latents', 'activation'], [1.0, 2.0])
    """
    labels_N = torch.as_tensor(labels)
    if len(torch.unique(labels_N)) != 2:
        raise InputError(f"a sparse probe separates two classes; the labels hold {len(torch.unique(labels_N))}")
    hook_name = sae.cfg.hook_name
    model.check_hook_names([hook_name])
    k_values = tuple(int(k) for k in k_values)
    if not k_values or any(not 0 < k <= sae.cfg.d_sae for k in k_values):
        raise InputError(f"every k must be from 1 to d_sae={sae.cfg.d_sae}, got {k_values}")
    acts_Ni = probe_activations(model, texts, [hook_name], reading, batch_size, progress)[hook_name]
    with torch.no_grad():
        latents_NX = sae.encode(acts_Ni.to(sae.W_enc.dtype)).float()
    _, labels_N = torch.unique(labels_N, return_inverse=True)   # 0 and 1, in sorted order
    splits = [stratified_split(labels_N, test_fraction, seed) for seed in seeds]
    fit = (lambda x, y: fit_logistic(x, y, C=C))
    rows = []
    for k in (*k_values, None):
        if k is None:   # the raw activation, read whole
            _, scores, _ = held_out_scores(acts_Ni, labels_N, splits, fit)
            latents = []
        else:           # each split chooses its k latents on its own training rows
            choose = (lambda train, k=k: top_k_mean_diff(latents_NX[train], labels_N[train], k))
            _, scores, first_choice = held_out_scores(latents_NX, labels_N, splits, fit, choose)
            latents = first_choice.tolist()
        rows.append({"inputs": "activation" if k is None else "sae latents", "k": float("nan") if k is None else k,
                     **scores, "latents": latents, "hook_name": hook_name, "seeds": len(splits)})
    return pd.DataFrame.from_records(rows)
