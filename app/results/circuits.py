"""The Circuits page's results: a task's prompt pairs (IOI or induction, as ``python -m experiments.circuits --task``
builds them, or one typed pair with a logit difference), every edge's attribution score (EAP or EAP-IG: a long run),
the circuit its strongest edges make and its bounded drawing, the faithfulness curve (a long run) and the circuit's
own faithfulness, one edge's exact patching effect, and the first clean prompt's tokens for the heads' patterns.

Scores and curves are ``LongRun``s (the page hands in the progress bar); what is derived from the scores reads them
back from that store and is cached on the model's key and the call's arguments (``BY_MODEL_KEY``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import pandas as pd
import streamlit as st

from app.results.long_runs import LongRun, ProgressBar, no_bar
from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments.circuits import (Circuit, EdgeScores, Faithfulness, PairedPrompts, circuit_from_scores,
                                  edge_attribution_patching, edge_patching, faithfulness)
from experiments.circuits import faithfulness_curve as _faithfulness_curve
from experiments.circuits.tasks import induction_pairs
from experiments.datasets import ioi_dataset
from experiments.plots.circuits import CircuitDrawing
from experiments.plots.circuits import circuit_drawing as _circuit_drawing

BATCH_SIZE = 16  # pairs per pass, the command's default
# The page's defaults: a faithful circuit on SmolLM2-135M in well under a minute. The typed IOI pair
# (``app.widgets.DEFAULT_CLEAN`` -> " Mary" over " John"), EAP-IG with 5 steps, and its 200 strongest edges under
# corrupt ablation recover 0.75 of the logit difference (docs/guides/circuits.md has the measurement). The induction
# task on random tokens needs thousands of SmolLM2's edges (the old default's 50 recovered -0.0004), and the IOI
# dataset's passes grow with its pairs (4 pairs took about 5 times the single pair's time).
DEFAULT_TASK, DEFAULT_METHOD, DEFAULT_IG_STEPS, DEFAULT_TOP_N, DEFAULT_ABLATION = "pair", "eap-ig", 5, 200, "corrupt"


@dataclass(frozen=True)
class CircuitTask:
    """The behaviour a circuit is found for: ``kind`` "ioi" (``n`` IOI pairs from ``seed``, single-token ``names``
    or the default ones), "induction" (``n`` repeated random sequences of ``seq_len`` tokens from ``seed``) or "pair"
    (the ``clean`` and ``corrupt`` texts with logit[``answer``] - logit[``wrong``] at the last token). Hashable: results
    are cached on it.

    Example:
        >>> pairs = task_pairs(model, CircuitTask("induction", n=2, seq_len=5))
        >>> pairs.size, pairs.clean.tokens.shape
        (2, torch.Size([2, 11]))
    """

    kind: str
    n: int = 8
    seed: int = 0
    seq_len: int = 10
    names: tuple[str, ...] = ()
    clean: str = ""
    corrupt: str = ""
    answer: int = 0
    wrong: int = 0


def task_pairs(model, task: CircuitTask) -> PairedPrompts:
    """The task's clean and corrupted prompts with their metric (``InputError`` for what the model cannot build,
    e.g. IOI names that are not one token).

    Example:
        >>> pair = CircuitTask("pair", clean="The cat sat", corrupt="The dog sat", answer=5, wrong=6)
        >>> task_pairs(model, pair).size
        1
    """
    if task.kind == "ioi":
        return PairedPrompts.from_prompts(model, ioi_dataset(model, task.n, seed=task.seed, names=list(task.names) or None))
    if task.kind == "induction":
        return induction_pairs(model, task.seq_len, task.n, task.seed)
    return PairedPrompts.from_prompts(model, [task.clean], [task.corrupt], [task.answer], [task.wrong])


def _scores(model, task: CircuitTask, method: str, ig_steps: int, progress) -> EdgeScores:
    return edge_attribution_patching(model, task_pairs(model, task), method=method, ig_steps=ig_steps,
                                     batch_size=BATCH_SIZE, progress=progress)


_SCORES = LongRun("Scoring every edge (one forward and backward pass per batch and step)", _scores)


def edge_scores(loaded: LoadedModel, task: CircuitTask, method: str, ig_steps: int, bar: ProgressBar) -> EdgeScores:
    """Every edge's score over the task's pairs (``edge_attribution_patching``, EAP or EAP-IG), with a progress bar,
    kept in the long-run store.

    Example:
        >>> quiet = lambda text: ((lambda done, total: None), (lambda: None))
        >>> loaded, task = LoadedModel(model, "toy-attn-2l|sdpa"), CircuitTask("induction", n=2, seq_len=5)
        >>> edge_scores(loaded, task, "eap", 1, bar=quiet).scores.shape        # [pos, writers, readers]
        torch.Size([11, 9, 25])
        >>> has_edge_scores(loaded, task, "eap", 1), has_edge_scores(loaded, task, "eap-ig", 5)
        (True, False)
    """
    return _SCORES(loaded, task, method, ig_steps, bar=bar)


def has_edge_scores(loaded: LoadedModel, task: CircuitTask, method: str, ig_steps: int) -> bool:
    """Whether ``edge_scores`` of these arguments is stored (returns at once, draws no bar).

    Example:
        >>> has_edge_scores(LoadedModel(model, "toy-attn-2l|sdpa"), CircuitTask("induction", n=3), "eap", 1)
        False
    """
    return _SCORES.is_stored(loaded, task, method, ig_steps)


@st.cache_data(show_spinner=False, max_entries=32, hash_funcs=BY_MODEL_KEY)
def circuit(loaded: LoadedModel, task: CircuitTask, method: str, ig_steps: int, top_n: Optional[int],
            threshold: Optional[float]) -> Circuit:
    """The circuit of the ``top_n`` strongest edges (or those with |score| >= ``threshold``), scores summed over
    positions (``circuit_from_scores``; the scores are ``edge_scores``', recomputed without a bar if the store let
    them go).

    Example:
        >>> loaded, task = LoadedModel(model, "toy-attn-2l|sdpa"), CircuitTask("induction", n=2, seq_len=5)
        >>> circuit(loaded, task, "eap", 1, 3, None).n_edges
        3
    """
    return circuit_from_scores(_SCORES(loaded, task, method, ig_steps, bar=no_bar), top_n, threshold)


@st.cache_data(show_spinner=False, max_entries=32, hash_funcs=BY_MODEL_KEY)
def circuit_table(loaded: LoadedModel, task: CircuitTask, method: str, ig_steps: int, top_n: Optional[int],
                  threshold: Optional[float], rows: int) -> pd.DataFrame:
    """The circuit's ``rows`` strongest edges (``Circuit.to_frame``: edge, writer, reader, score).

    Example:
        >>> loaded, task = LoadedModel(model, "toy-attn-2l|sdpa"), CircuitTask("induction", n=2, seq_len=5)
        >>> circuit_table(loaded, task, "eap", 1, 10, None, 3).columns.tolist()
        ['edge', 'writer', 'reader', 'score']
    """
    return circuit(loaded, task, method, ig_steps, top_n, threshold).to_frame().head(rows)


@st.cache_data(show_spinner="Drawing the circuit …", max_entries=32, hash_funcs=BY_MODEL_KEY)
def circuit_drawing(loaded: LoadedModel, task: CircuitTask, method: str, ig_steps: int, top_n: Optional[int],
                    threshold: Optional[float], min_score: float, max_nodes: int, max_edges: int,
                    selected: Optional[str]) -> CircuitDrawing:
    """The circuit drawn with its edges of |score| at least ``min_score`` of the largest, at most ``max_nodes``
    nodes and ``max_edges`` edges (``experiments.plots.circuits.circuit_drawing``).

    Example:
        >>> loaded, task = LoadedModel(model, "toy-attn-2l|sdpa"), CircuitTask("induction", n=2, seq_len=5)
        >>> len(circuit_drawing(loaded, task, "eap", 1, 10, None, 0.0, 150, 4, None).edges)
        4
    """
    found = circuit(loaded, task, method, ig_steps, top_n, threshold)
    return _circuit_drawing(found, min_score, max_nodes, max_edges, selected)


@dataclass(frozen=True)
class _Held:
    """Scores or a circuit handed to a long run, compared (and stored) by the arguments that made them (the task
    first)."""

    made_by: tuple
    value: Any = field(default=None, compare=False, repr=False)


def _curve(model, scores: _Held, ablation: str, progress) -> pd.DataFrame:
    return _faithfulness_curve(model, task_pairs(model, scores.made_by[0]), scores.value, ablation=ablation,
                               batch_size=BATCH_SIZE, progress=progress)


_CURVE = LongRun("The faithfulness curve (the circuits of 12 sizes, ablated runs stacked)", _curve)


def faithfulness_curve(loaded: LoadedModel, task: CircuitTask, method: str, ig_steps: int, ablation: str,
                       bar: ProgressBar) -> pd.DataFrame:
    """The share of the clean - corrupt gap the strongest k edges keep, for 12 sizes k from one edge to all
    (``experiments.circuits.faithfulness_curve``), with a progress bar, kept in the long-run store.

    Example:
        >>> quiet = lambda text: ((lambda done, total: None), (lambda: None))
        >>> loaded, task = LoadedModel(model, "toy-attn-2l|sdpa"), CircuitTask("induction", n=2, seq_len=5)
        >>> curve = faithfulness_curve(loaded, task, "eap", 1, "corrupt", bar=quiet)
        >>> int(curve["n_edges"].iloc[-1]), round(float(curve["recovered"].iloc[-1]), 4)    # every edge: the clean run
        (81, 1.0)
        >>> [has_faithfulness_curve(loaded, task, "eap", 1, ablation) for ablation in ("corrupt", "zero")]
        [True, False]
    """
    scores = _SCORES(loaded, task, method, ig_steps, bar=bar)   # stored by the page's run: no bar
    return _CURVE(loaded, _Held((task, method, ig_steps), scores), ablation, bar=bar)


def has_faithfulness_curve(loaded: LoadedModel, task: CircuitTask, method: str, ig_steps: int, ablation: str) -> bool:
    """Whether ``faithfulness_curve`` of these arguments is stored (returns at once, draws no bar).

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> has_faithfulness_curve(loaded, CircuitTask("induction", n=3), "eap", 1, "zero")
        False
    """
    return _CURVE.is_stored(loaded, _Held((task, method, ig_steps)), ablation)


def _faithfulness(model, found: _Held, ablation: str, progress) -> Faithfulness:
    return faithfulness(model, task_pairs(model, found.made_by[0]), found.value, ablation, batch_size=BATCH_SIZE,
                        progress=progress)


_FAITHFULNESS = LongRun("The circuit's faithfulness (every other edge ablated)", _faithfulness)


def circuit_faithfulness(loaded: LoadedModel, task: CircuitTask, method: str, ig_steps: int, top_n: Optional[int],
                         threshold: Optional[float], ablation: str, bar: ProgressBar) -> Faithfulness:
    """How much of the clean - corrupt gap the circuit keeps with every other edge ablated (``faithfulness``), with
    a progress bar, kept in the long-run store.

    Example:
        >>> quiet = lambda text: ((lambda done, total: None), (lambda: None))
        >>> loaded, task = LoadedModel(model, "toy-attn-2l|sdpa"), CircuitTask("induction", n=2, seq_len=5)
        >>> circuit_faithfulness(loaded, task, "eap", 1, 81, None, "corrupt", bar=quiet).recovered
        1.0
        >>> has_circuit_faithfulness(loaded, task, "eap", 1, 81, None, "corrupt")
        True
    """
    found = circuit(loaded, task, method, ig_steps, top_n, threshold)
    return _FAITHFULNESS(loaded, _Held((task, method, ig_steps, top_n, threshold), found), ablation, bar=bar)


def has_circuit_faithfulness(loaded: LoadedModel, task: CircuitTask, method: str, ig_steps: int,
                             top_n: Optional[int], threshold: Optional[float], ablation: str) -> bool:
    """Whether ``circuit_faithfulness`` of these arguments is stored (returns at once, draws no bar).

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> has_circuit_faithfulness(loaded, CircuitTask("induction", n=3), "eap", 1, 5, None, "zero")
        False
    """
    return _FAITHFULNESS.is_stored(loaded, _Held((task, method, ig_steps, top_n, threshold)), ablation)


@st.cache_data(show_spinner="Patching the edge …", max_entries=64, hash_funcs=BY_MODEL_KEY)
def edge_effect(loaded: LoadedModel, task: CircuitTask, edge: str) -> dict:
    """The exact effect of patching ``edge`` toward clean at every position (``edge_patching``): its row (``metric``,
    ``delta``, ``normalized``) with the clean and corrupted metrics.

    Example:
        >>> loaded, task = LoadedModel(model, "toy-attn-2l|sdpa"), CircuitTask("induction", n=2, seq_len=5)
        >>> sorted(edge_effect(loaded, task, "a0.h0->a1.h1<k>"))
        ['clean_metric', 'corrupt_metric', 'delta', 'metric', 'normalized']
    """
    with loaded.lock:
        table = edge_patching(loaded.model, task_pairs(loaded.model, task), edges=[edge], batch_size=BATCH_SIZE)
    row = table.iloc[0]
    return {"metric": float(row["metric"]), "delta": float(row["delta"]), "normalized": float(row["normalized"]),
            "clean_metric": float(table.attrs["clean_metric"]), "corrupt_metric": float(table.attrs["corrupt_metric"])}


@st.cache_data(show_spinner=False, max_entries=32, hash_funcs=BY_MODEL_KEY)
def first_clean_ids(loaded: LoadedModel, task: CircuitTask) -> tuple[int, ...]:
    """The first clean prompt's token ids, padding left out: where the page draws the heads' patterns.

    Example:
        >>> first_clean_ids(LoadedModel(model, "toy-attn-2l|sdpa"), CircuitTask("induction", n=2, seq_len=3))[:1]
        (0,)
    """
    batch = task_pairs(loaded.model, task).clean
    ids = batch.tokens[0] if batch.mask is None else batch.tokens[0][batch.mask[0]]
    return tuple(int(i) for i in ids.tolist())
