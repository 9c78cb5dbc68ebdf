"""Circuits: a set of edges, found by attribution (``discover_circuit``) or greedy exact pruning (``acdc``), and how
faithful it is (``faithfulness``, ``faithfulness_curve``).

Legend: B batch, P position, O circuit writers, I circuit readers, D d_model.

Faithfulness runs the clean prompts with every edge outside the circuit ablated (its reader's input takes the
ablated value of that writer: the corrupted run's, its mean over the corrupted prompts, or zero) and reports the
share of the clean - corrupt gap the circuit keeps: (circuit - corrupt) / (clean - corrupt), of the means over
pairs, as TransformerLens's ``faithfulness`` does for one pair.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.circuits.eap import EdgeScores, Method, edge_attribution_patching
from experiments.circuits.exact import patched_values
from experiments.circuits.graph import CircuitGraph, circuit_graph
from experiments.circuits.runs import base_run, edge_switches, patched_metric, source_values, writer_values
from experiments.metrics import MetricLike
from experiments.patching.pairs import PairedPrompts, takes_pairs
from workbench.errors import InputError

Ablation = Literal["corrupt", "mean", "zero"]


@dataclass(frozen=True, eq=False)
class Circuit:
    """Edges of a graph: ``mask`` [O, I] (at every position) or [P, O, I] (edges at positions), with their scores.

    Example:
        >>> graph = circuit_graph(model)
        >>> circuit = Circuit(graph, graph.edges_mask(["a0.h0->a1.h1<k>", "a1.h1->logits"]))
        >>> circuit.edges, circuit.nodes, circuit.heads
        (['a0.h0->a1.h1<k>', 'a1.h1->logits'], ['a0.h0', 'a1.h1', 'logits'], [(0, 0), (1, 1)])
    """

    graph: CircuitGraph
    mask: Bool[Tensor, "*pos writers readers"]
    scores: Optional[Float[Tensor, "*pos writers readers"]] = None
    method: str = ""
    attrs: dict = field(default_factory=dict)

    @property
    def edges(self) -> list[str]:
        """Edge names (``writer->reader``, with ``@position`` for edges at one position), writer-major."""
        if self.mask.ndim == 2:
            return self.graph.edge_names(self.mask)
        return [f"{self.graph.edge_name(w, r)}@{p}" for p, w, r in self.mask.nonzero().tolist()]

    @property
    def n_edges(self) -> int:
        return int(self.mask.sum())

    @property
    def share(self) -> float:
        """The circuit's share of the graph's edges (of edges x positions for a per-position circuit)."""
        total = self.graph.n_edges * (self.mask.shape[0] if self.mask.ndim == 3 else 1)
        return self.n_edges / total

    @property
    def nodes(self) -> list[str]:
        """The components the edges join (``input``, ``a{l}.h{h}``, ``m{l}``, ``logits``), in graph order."""
        edge_mask = self.mask if self.mask.ndim == 2 else self.mask.any(0)
        used = {self.graph.writers[w] for w in edge_mask.any(1).nonzero().flatten().tolist()}
        used |= {self.graph.node_of(self.graph.readers[r]) for r in edge_mask.any(0).nonzero().flatten().tolist()}
        order = self.graph.writers + ["logits"]
        return [name for name in order if name in used]

    @property
    def heads(self) -> list[tuple[int, int]]:
        """(layer, head) of every head among the nodes."""
        return [(int(n[1:].split(".")[0]), int(n.split(".h")[1])) for n in self.nodes if n.startswith("a")]

    def to_frame(self) -> pd.DataFrame:
        """DataFrame[edge, writer, reader, (position), score], strongest |score| first.

        Example:
            >>> graph = circuit_graph(model)
            >>> Circuit(graph, graph.edges_mask(["input->logits"])).to_frame().columns.tolist()
            ['edge', 'writer', 'reader', 'score']
        """
        index = self.mask.nonzero().tolist()
        rows = []
        for item in index:
            p, (w, r) = (item[0], item[1:]) if self.mask.ndim == 3 else (None, item)
            score = float(self.scores[tuple(item)]) if self.scores is not None else np.nan
            row = {"edge": self.graph.edge_name(w, r), "writer": self.graph.writers[w], "reader": self.graph.readers[r]}
            rows.append({**row, **({"position": p} if p is not None else {}), "score": score})
        columns = ["edge", "writer", "reader"] + (["position"] if self.mask.ndim == 3 else []) + ["score"]
        table = pd.DataFrame(rows, columns=columns)
        return table.iloc[np.argsort(-np.abs(table["score"].to_numpy()), kind="stable")].reset_index(drop=True)

    def to_json(self) -> str:
        """The circuit as JSON: method, attrs, edges with their scores, nodes.

        Example:
            >>> graph = circuit_graph(model)
            >>> json.loads(Circuit(graph, graph.edges_mask(["input->logits"])).to_json())["edges"][0]["edge"]
            'input->logits'
        """
        table = self.to_frame()
        return json.dumps({"method": self.method, "attrs": _jsonable(self.attrs), "n_edges": self.n_edges,
                           "share": self.share, "nodes": self.nodes,
                           "edges": json.loads(table.to_json(orient="records"))}, indent=1)


def _jsonable(attrs: dict) -> dict:
    return {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in attrs.items()
            if isinstance(v, (int, float, str, bool, list, np.floating))}


def as_pairs(model, dataset, metric: Optional[MetricLike] = None) -> PairedPrompts:
    """The older name of ``PairedPrompts.from_prompts`` for a dataset: an ``IOIDataset``, ``PairedPrompts`` or a
    (clean, corrupt[, clean_mask, corrupt_mask]) tuple, with ``metric`` (kept or defaulted when None).

    Example:
        >>> as_pairs(model, (tokens, tokens), lambda logits, tokens: logits[:, -1, 0]).size
        1
    """
    return PairedPrompts.from_prompts(model, dataset, metric=metric)


def circuit_from_scores(scores: EdgeScores, top_n: Optional[int] = None, threshold: Optional[float] = None,
                        per_position: bool = False) -> Circuit:
    """The ``top_n`` edges by |score| (or those with |score| >= ``threshold``), summed over positions unless
    ``per_position``.

    Example:
        >>> from experiments.metrics import logit_diff
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> scores = edge_attribution_patching(model, tokens, corrupt, logit_diff(model, " s", " and", 1))
        >>> circuit_from_scores(scores, top_n=3).edges
        ['a0.h1->a1.h0<v>', 'a0.h1->logits', 'a1.h1->logits']
    """
    if (top_n is None) == (threshold is None):
        raise InputError("give exactly one of top_n (the number of edges) and threshold (the smallest |score| kept)")
    values = scores.scores if per_position else scores.summed()
    if values.ndim != 2 + int(per_position):
        raise InputError("a circuit comes from mean scores: run edge_attribution_patching without per_prompt")
    magnitude = values.abs().masked_fill(~scores.graph.edge_mask, -1.0)
    if top_n is not None:
        if top_n < 0:
            raise InputError(f"top_n must be at least 0, got {top_n}")
        flat = magnitude.flatten()
        keep = torch.zeros_like(flat, dtype=torch.bool)
        keep[flat.topk(min(top_n, int((flat >= 0).sum()))).indices] = True
        mask = keep.view(magnitude.shape)
    else:
        mask = magnitude >= threshold
    return Circuit(scores.graph, mask & scores.graph.edge_mask, values * mask, scores.method,
                   {**scores.attrs, "top_n": top_n, "threshold": threshold})


@takes_pairs("dataset")
def discover_circuit(model, pairs: PairedPrompts, *, method: Method = "eap-ig",
                     top_n: Optional[int] = None, threshold: Optional[float] = None, ig_steps: int = 5,
                     batch_size: int = 16, progress: ProgressArg = False) -> Circuit:
    """The circuit of the behaviour ``pairs`` shows: edges scored by EAP or EAP-IG over the pairs (summed over
    positions), the ``top_n`` strongest kept (or those with |score| >= ``threshold``). ``pairs``: a ``PairedPrompts``;
    the older form (``dataset, metric=None``: an ``IOIDataset``, ``PairedPrompts`` or a (clean, corrupt[, masks])
    tuple, and a metric) is still taken, here and by ``faithfulness``, ``faithfulness_curve`` and ``acdc``.

    Example:
        >>> from experiments.circuits.tasks import induction_pairs
        >>> circuit = discover_circuit(model, induction_pairs(model, seq_len=8, n=4), top_n=20, ig_steps=2)
        >>> "a0.h0->a1.h1<k>" in circuit.edges                       # previous-token head -> induction head
        True
    """
    scores = edge_attribution_patching(model, pairs, method=method, ig_steps=ig_steps, batch_size=batch_size,
                                       progress=progress)
    return circuit_from_scores(scores, top_n, threshold)


@dataclass(frozen=True)
class Faithfulness:
    """The share of the clean - corrupt gap a circuit keeps, and the metrics it comes from (means over pairs)."""

    recovered: float
    circuit_metric: float
    clean_metric: float
    corrupt_metric: float
    n_edges: int
    total_edges: int


def _ablation_masks(circuit: Circuit, P: int) -> Tensor:
    """The edges to ablate: every edge outside the circuit, [1, P or 1, O, I]."""
    mask = circuit.mask if circuit.mask.ndim == 3 else circuit.mask[None]
    if mask.shape[0] not in (1, P):
        raise InputError(f"the circuit has edges at {mask.shape[0]} positions but the prompts have {P}")
    return (~mask & circuit.graph.edge_mask)[None]


def _ablated_runs(model, graph: CircuitGraph, data: PairedPrompts, masks: Tensor, ablation: Ablation,
                  batch_size: int, progress: ProgressArg) -> tuple[Tensor, Tensor, Tensor]:
    if ablation not in ("corrupt", "mean", "zero"):
        raise InputError(f"ablation must be 'corrupt', 'mean' or 'zero', got {ablation!r}")
    sources = None
    if ablation != "corrupt":
        with edge_switches(model):
            sources = source_values(model, graph, data.corrupt, ablation)
    return patched_values(model, graph, data, masks, batch_size, progress, base="clean", sources=sources)


@takes_pairs("dataset")
def faithfulness(model, pairs: PairedPrompts, circuit: Circuit, ablation: Ablation = "corrupt", *,
                 batch_size: int = 16, progress: ProgressArg = False) -> Faithfulness:
    """How much of the clean - corrupt gap ``circuit`` keeps with every other edge ablated (``"corrupt"``: the
    corrupted run's writer values; ``"mean"``: their mean over the corrupted prompts at each position; ``"zero"``).

    Example:
        >>> graph = circuit_graph(model)
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> from experiments.metrics import logit_diff
        >>> whole = Circuit(graph, graph.edge_mask)
        >>> pairs = PairedPrompts.from_prompts(model, tokens, corrupt, metric=logit_diff(model, " s", " and", 1))
        >>> round(faithfulness(model, pairs, whole).recovered, 4)
        1.0
    """
    values, clean_R, corrupt_R = _ablated_runs(model, circuit.graph, pairs, _ablation_masks(circuit, pairs.clean.tokens.shape[1]),
                                               ablation, batch_size, progress)
    clean, corrupt, kept = float(clean_R.mean()), float(corrupt_R.mean()), float(values.mean())
    total = circuit.graph.n_edges * (circuit.mask.shape[0] if circuit.mask.ndim == 3 else 1)
    return Faithfulness((kept - corrupt) / (clean - corrupt) if clean != corrupt else float("nan"), kept, clean,
                        corrupt, circuit.n_edges, total)


@takes_pairs("dataset")
def faithfulness_curve(model, pairs: PairedPrompts, scores: EdgeScores,
                       sizes: Optional[Sequence[int]] = None, ablation: Ablation = "corrupt", *, batch_size: int = 16,
                       progress: ProgressArg = False) -> pd.DataFrame:
    """Faithfulness of the top-k edges by |score| for each k of ``sizes`` (default: 12 sizes from one edge to all, on
    a log scale): DataFrame[n_edges, share, metric, recovered], the circuits stacked as variants of one pass.

    Example:
        >>> from experiments.metrics import logit_diff
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> scores = edge_attribution_patching(model, tokens, corrupt, logit_diff(model, " s", " and", 1))
        >>> curve = faithfulness_curve(model, (tokens, corrupt), logit_diff(model, " s", " and", 1), scores, [0, 81])
        >>> # (the older form above; PairedPrompts first, as faithfulness's example, is the same call)
        >>> (curve["recovered"].round(4) + 0.0).tolist()               # no edge: the corrupted run; all: the clean one
        [0.0, 1.0]
    """
    graph = scores.graph
    total = graph.n_edges
    if sizes is None:
        sizes = sorted({int(round(x)) for x in np.geomspace(1, total, 12)})
    circuits = [circuit_from_scores(scores, top_n=int(k)) for k in sizes]
    masks = torch.cat([_ablation_masks(c, pairs.clean.tokens.shape[1]) for c in circuits])
    values, clean_R, corrupt_R = _ablated_runs(model, graph, pairs, masks, ablation, batch_size, progress)
    clean, corrupt = float(clean_R.mean()), float(corrupt_R.mean())
    kept = values.mean(1).numpy()
    table = pd.DataFrame({"n_edges": [c.n_edges for c in circuits], "share": [c.n_edges / total for c in circuits],
                          "metric": kept, "recovered": (kept - corrupt) / (clean - corrupt)})
    table.attrs.update(clean_metric=clean, corrupt_metric=corrupt, ablation=ablation, method=scores.method)
    return table


@takes_pairs("dataset")
def acdc(model, pairs: PairedPrompts, threshold: float, *, ablation: Ablation = "corrupt",
         batch_size: int = 16, progress: ProgressArg = False) -> Circuit:
    """ACDC (Conmy et al. 2023): greedy exact pruning. From the whole graph, readers in reverse topological order
    (logits first), each of a reader's edges (latest writer first) is ablated for good when that moves the dataset's
    mean metric by less than ``threshold`` from the current circuit's; a component none of whose outputs is left loses
    its inputs without a test. One pass per edge tested: sized for small models.

    Example:
        >>> from experiments.circuits.tasks import induction_pairs
        >>> circuit = acdc(model, induction_pairs(model, seq_len=6, n=2), threshold=0.3)
        >>> circuit.n_edges < circuit.graph.n_edges
        True
    """
    graph = circuit_graph(model)
    if ablation not in ("corrupt", "mean", "zero"):
        raise InputError(f"ablation must be 'corrupt', 'mean' or 'zero', got {ablation!r}")
    with edge_switches(model):  # the whole search: the switches on, and so the model's lock held, until it ends
        return _acdc(model, graph, pairs, threshold, ablation, batch_size, progress)


def _acdc(model, graph: CircuitGraph, pairs: PairedPrompts, threshold: float, ablation: Ablation, batch_size: int,
          progress: ProgressArg) -> Circuit:
    kept = graph.edge_mask.clone()
    # the ablated values, once: each test is then one pass per chunk of pairs
    shared = None if ablation == "corrupt" else source_values(model, graph, pairs.corrupt, ablation)
    chunks = [pairs.rows(start, min(start + batch_size, pairs.size)) for start in range(0, pairs.size, batch_size)]
    sources = [shared or writer_values(model, graph, part.corrupt) for part in chunks]
    starts = [base_run(model, graph, part.clean) for part in chunks]

    def score(mask: Tensor) -> float:
        masks = (~mask & graph.edge_mask)[None, None]
        values = [patched_metric(model, graph, part.clean, part.metric, masks, source, start)
                  for part, source, start in zip(chunks, sources, starts)]
        return float(torch.cat(values, 1).mean())

    current = score(kept)
    scores = torch.zeros(kept.shape)
    with Progress(progress, total=graph.n_edges, desc="acdc") as bar:
        for r in reversed(range(len(graph.readers))):
            node = graph.node_of(graph.readers[r])
            writers = kept[:, r].nonzero().flatten().tolist()
            alive = node == "logits" or bool(kept[graph.writer_index(node)].any())
            for w in reversed(writers):
                trial = kept.clone()
                trial[w, r] = False
                value = score(trial) if alive else current
                scores[w, r] = value - current
                if abs(value - current) < threshold or not alive:
                    kept, current = trial, value
                bar.advance()
            bar.advance(int(graph.n_before[r]) - len(writers))
    return Circuit(graph, kept, scores * kept, "acdc", {"threshold": threshold, "metric": current})
