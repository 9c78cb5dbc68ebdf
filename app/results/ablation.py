"""The Ablation, Token view and Generate pages' results: what knocking out heads, layers, neurons or
experts does to the loss, the top predictions and the continuation, and every head swept in turn.
"""

from __future__ import annotations

from typing import Optional

import pandas as pd
import streamlit as st
import torch

import workbench as wb
from app.results.long_runs import LongRun, ProgressBar
from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments import ablation, continuations
from experiments.metrics import LogitDiff, TokenProbability

# (kind, layer, index) of each thing to ablate: tuples, so the ablation result can be cached on them.
Targets = tuple[tuple[str, int, Optional[int]], ...]
# Reference prompts' token ids for mean / resample ablation (None for zero ablation).
Reference = Optional[tuple[tuple[int, ...], ...]]


def _reference_tensor(reference: Reference) -> Optional[torch.Tensor]:
    return torch.tensor(reference) if reference else None


@st.cache_data(show_spinner="Running the ablation …", max_entries=32, hash_funcs=BY_MODEL_KEY)
def ablation_effects(loaded: LoadedModel, ids: tuple[int, ...], targets: Targets, method: str,
                     reference: Reference) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The per-token loss change and the top-5 next-token predictions, clean and with ``targets`` ablated.

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> per_token, top = ablation_effects(loaded, tuple(tokens[0].tolist()), (("head", 1, 3),), "zero", None)
        >>> len(per_token) == tokens.shape[1] - 1, bool((per_token["delta"] != 0).any())
        (True, True)
    """
    tokens, ref = torch.tensor([ids]), _reference_tensor(reference)
    chosen = [ablation.AblationTarget(kind, layer, index) for kind, layer, index in targets]
    with loaded.lock:  # one clean and one ablated forward serve both tables
        return ablation.loss_and_top_predictions_change(loaded.model, tokens, chosen, method, k=5, reference_tokens=ref)


# What a head sweep scores: ("loss",) the whole prompt's mean loss; ("probability", answer) the answer's probability
# at the last token; ("logit_diff", answer, wrong) its logit minus the wrong token's there. A tuple: a cache key.
SweepMetric = tuple


def sweep_metric(spec: SweepMetric):
    """The ``experiments.metrics`` metric (or "loss") a ``SweepMetric`` names; an ``InputError`` for another name.

    Example:
        >>> sweep_metric(("loss",)), type(sweep_metric(("logit_diff", 5, 7))).__name__
        ('loss', 'LogitDiff')
    """
    name, *tokens = spec
    if name == "loss":
        return "loss"
    if name == "probability" and len(tokens) == 1:
        return TokenProbability(torch.tensor(tokens), position="last")
    if name == "logit_diff" and len(tokens) == 2:
        return LogitDiff(torch.tensor(tokens[:1]), torch.tensor(tokens[1:]), position="last")
    raise wb.InputError(f"a head sweep scores ('loss',), ('probability', answer) or ('logit_diff', answer, wrong); "
                        f"got {spec!r}")


@st.cache_data(show_spinner=False, max_entries=32, hash_funcs=BY_MODEL_KEY)
def last_token_predictions(loaded: LoadedModel, ids: tuple[int, ...], k: int) -> tuple[tuple[int, float], ...]:
    """The clean model's ``k`` most likely next tokens after the prompt's last token: (id, probability), likeliest
    first (the head sweep's default answer and runner-up when nothing is ablated; with an ablation,
    ``ablation_effects``' top table holds them from its clean forward).

    Example:
        >>> top = last_token_predictions(LoadedModel(model, "toy-attn-2l|sdpa"), tuple(tokens[0].tolist()), 2)
        >>> len(top), top[0][1] >= top[1][1]
        (2, True)
    """
    with loaded.lock:
        top = ablation.top_predictions(loaded.model, torch.tensor([ids]), k)
    return tuple((int(i), float(p)) for i, p in zip(top["token_id"], top["prob"]))


def _head_sweep(model, ids: tuple[int, ...], method: str, reference: Reference, metric: SweepMetric,
                progress) -> pd.DataFrame:
    return ablation.head_sweep(model, torch.tensor([ids]), sweep_metric(metric), method,
                               reference_tokens=_reference_tensor(reference), progress=progress)


_HEAD_SWEEP = LongRun("Sweeping heads", _head_sweep)


def head_sweep(loaded: LoadedModel, ids: tuple[int, ...], method: str, reference: Reference,
               bar: ProgressBar, metric: SweepMetric = ("loss",)) -> pd.DataFrame:
    """The change in ``metric`` (a ``SweepMetric``: the loss by default, or the answer's probability or logit
    difference at the last token) when each head in turn is ablated (``method``), with a progress bar, kept in the
    long-run store.

    Example:
        >>> quiet = lambda text: ((lambda done, total: None), (lambda: None))
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> len(head_sweep(loaded, tuple(tokens[0].tolist()), "zero", None, bar=quiet))   # 2 layers x 4 heads
        8
    """
    return _HEAD_SWEEP(loaded, ids, method, reference, tuple(metric), bar=bar)


def has_head_sweep(loaded: LoadedModel, ids: tuple[int, ...], method: str, reference: Reference,
                   metric: SweepMetric = ("loss",)) -> bool:
    """Whether ``head_sweep`` with these arguments is stored (returns at once, draws no bar).

    Example:
        >>> has_head_sweep(LoadedModel(model, "toy-attn-2l|sdpa"), (1, 2, 3), "zero", None)
        False
    """
    return _HEAD_SWEEP.is_stored(loaded, ids, method, reference, tuple(metric))


@st.cache_data(show_spinner="Generating both continuations …", max_entries=32, hash_funcs=BY_MODEL_KEY)
def continuation(loaded: LoadedModel, ids: tuple[int, ...], targets: Targets, method: str, reference: Reference,
                 max_new_tokens: int, temperature: float, top_k: Optional[int],
                 seed: int) -> "continuations.Continuations":
    """The clean continuation of the prompt beside the one with ``targets`` ablated (same settings and seed).

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> result = continuation(loaded, tuple(tokens[0].tolist()), (("head", 1, 3),), "zero", None, 5, 0.0, None, 0)
        >>> len(result.clean_str_tokens), len(result.ablated_str_tokens)
        (5, 5)
    """
    with loaded.lock:
        return continuations.continue_with_ablation(loaded.model, torch.tensor([ids]), targets, method, max_new_tokens,
                                                    temperature, top_k, seed, _reference_tensor(reference))
