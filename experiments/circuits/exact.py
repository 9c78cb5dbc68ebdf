"""Exact edge patching: the corrupted run with chosen edges carrying the clean run's values, many edges per pass.

Legend: B batch, P position, O circuit writers, I circuit readers, D d_model.

Patching edge (w, r) rebuilds reader r's input from the clean value of writer w and the values of every other
writer in this run: input_r + clean_w - corrupt_w. Edges patched together add up at each reader, so all the
edges into one reader give that reader exactly its clean input. Each edge (or set of edges) is one variant of
the corrupted batch; variants run stacked, as ``experiments.ablation.head_sweep`` stacks heads.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from experiments._batched import metric_from_final_resid
from experiments._progress import Progress, ProgressArg
from experiments.circuits.graph import CircuitGraph, EdgeLike, circuit_graph
from experiments.circuits.runs import as_variant_masks, base_run, edge_switches, patched_metric
from experiments.patching.pairs import PairedPrompts, takes_pairs
from workbench.errors import InputError

EdgeSpec = Union[EdgeLike, tuple[str, str, int]]


def edge_masks(graph: CircuitGraph, edges: Optional[Sequence[EdgeSpec]], P: int) -> tuple[Tensor, list[str], list[int]]:
    """One mask [P or 1, O, I] per edge (every edge of the graph when None), its name and position (-1: all).

    An edge is ``"writer->reader"``, a (writer, reader) pair, or (writer, reader, position) to patch one position.

    Example:
        >>> masks, names, positions = edge_masks(circuit_graph(model), ["a0.h0->a1.h1<k>", ("input", "logits", 3)], 10)
        >>> masks.shape, names, positions
        (torch.Size([2, 10, 9, 25]), ['a0.h0->a1.h1<k>', 'input->logits'], [-1, 3])
    """
    if edges is None:
        w, r = graph.edge_mask.nonzero(as_tuple=True)
        edges = [graph.edge_name(a, b) for a, b in zip(w.tolist(), r.tolist())]
    by_position = any(isinstance(e, tuple) and len(e) == 3 for e in edges)
    masks = torch.zeros(len(edges), P if by_position else 1, *graph.edge_mask.shape, dtype=torch.bool)
    names, positions = [], []
    for i, edge in enumerate(edges):
        position = -1
        if isinstance(edge, tuple) and len(edge) == 3:
            edge, position = edge[:2], int(edge[2])
            if not -P <= position < P:
                raise InputError(f"edge position {position} is outside the prompts' {P} positions")
            position %= P
        w, r = graph.edge_index(edge)
        masks[i, position if position >= 0 else slice(None), w, r] = True
        names.append(graph.edge_name(w, r))
        positions.append(position)
    return masks, names, positions


@takes_pairs("circuits")
def edge_patching(model, pairs: PairedPrompts, edges: Optional[Sequence[EdgeSpec]] = None, *, together: bool = False,
                  batch_size: int = 16, per_prompt: bool = False, progress: ProgressArg = False) -> pd.DataFrame:
    """The metric of the corrupted run with each edge (or, ``together=True``, all of ``edges`` at once) patched to clean.

    ``edges``: names ``"writer->reader"``, (writer, reader) pairs or (writer, reader, position) triples; None is
    every edge of the graph. ``pairs`` (or the older form) and the rest as ``edge_attribution_patching``. Returns
    DataFrame[edge, writer, reader, position, (prompt), metric, delta, normalized] (position -1: every position;
    delta = patched - corrupt, normalized = delta / (clean - corrupt), over the means), strongest |delta| first, its
    attrs holding the clean and corrupted metric. ``delta`` is what EAP's score approximates.

    Example:
        >>> from experiments.metrics import logit_diff
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> pairs = PairedPrompts.from_prompts(model, tokens, corrupt, metric=logit_diff(model, " s", " and", 1))
        >>> table = edge_patching(model, pairs, ["a1.h1->logits", "input->a1.h1<q>"])
        >>> [[edge, round(float(delta), 3)] for edge, delta in table[["edge", "delta"]].values]
        [['a1.h1->logits', 1.906], ['input->a1.h1<q>', 0.124]]
    """
    if batch_size < 1:
        raise InputError(f"batch_size must be at least 1, got {batch_size}")
    graph = circuit_graph(model)
    masks, names, positions = edge_masks(graph, edges, pairs.clean.tokens.shape[1])
    if together:
        masks = masks.any(0, keepdim=True)
    values, clean_R, corrupt_R = patched_values(model, graph, pairs, masks, batch_size, progress)
    labels = pd.DataFrame({"edge": names, "writer": [n.split("->")[0] for n in names],
                           "reader": [n.split("->")[1] for n in names], "position": positions})
    if together:
        labels = pd.DataFrame({"edge": [" + ".join(names)], "writer": ["+"], "reader": ["+"],
                               "position": [positions[0] if len(set(positions)) == 1 else -1]})
    return patching_table(labels, values, clean_R, corrupt_R, per_prompt)


def patched_values(model, graph: CircuitGraph, data: PairedPrompts, masks: Tensor, batch_size: int,
                   progress: ProgressArg = False, base: str = "corrupt", sources: Optional[dict] = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """([n, N] metric under each mask, [N] clean metric, [N] corrupted metric): the ``base`` run ("corrupt" or
    "clean") with the masked edges carrying the other run's values (or ``sources``, broadcast over pairs).

    Example:
        >>> from experiments.metrics import logit_diff
        >>> graph = circuit_graph(model)
        >>> data = PairedPrompts.from_prompts(model, tokens, model.to_tokens("The cat sat on the mat. The cut"),
        ...                                   metric=logit_diff(model, " s", " and", 1))
        >>> values, clean, corrupt = patched_values(model, graph, data, graph.edge_mask[None, None], 8)
        >>> torch.allclose(values[0], clean, atol=1e-4)                 # every edge patched: the clean run
        True
    """
    masks = as_variant_masks(graph, list(masks)) if masks.ndim == 4 else as_variant_masks(graph, masks)
    N = data.size
    chunks = [(start, min(start + batch_size, N)) for start in range(0, N, batch_size)]
    out, cleans, corrupts = [], [], []
    with edge_switches(model), torch.no_grad(), Progress(progress, total=len(chunks), desc="edge patching") as bar:
        for start, stop in chunks:
            part = data.rows(start, stop)
            runs = {"clean": part.clean, "corrupt": part.corrupt}
            if base not in runs:
                raise InputError(f"base must be 'clean' or 'corrupt', got {base!r}")
            # one unedited run of each side: the base one to start the variants from, the other for its writers;
            # both give their metric from their last residual stream
            unedited = {name: base_run(model, graph, batch) for name, batch in runs.items()}
            chunk_sources = sources if sources is not None else unedited["clean" if base == "corrupt" else "corrupt"].writers
            out.append(patched_metric(model, graph, runs[base], part.metric, masks, chunk_sources, unedited[base]))
            for name, store in (("clean", cleans), ("corrupt", corrupts)):
                store.append(metric_from_final_resid(model, unedited[name].final, runs[name], part.metric)[0].float().cpu())
            bar.advance()
    return _join(out), torch.cat(cleans), torch.cat(corrupts)


def _join(parts: list[Tensor]) -> Tensor:
    """Chunks of [n, rows] joined over pairs; a batch-level metric ([n, 1] per chunk) as the chunks' mean."""
    if all(p.shape[1] == 1 for p in parts) and len(parts) > 1:
        return torch.cat(parts, 1).mean(1, keepdim=True)
    return torch.cat(parts, 1)


def patching_table(labels: pd.DataFrame, values_nR: Tensor, clean_R: Tensor, corrupt_R: Tensor,
                   per_prompt: bool) -> pd.DataFrame:
    """``labels`` (one row per variant) with metric, delta and normalized (means over pairs, or per pair), strongest
    |delta| first.

    Example:
        >>> patching_table(pd.DataFrame({"edge": ["x", "y"]}), torch.tensor([[1.0], [3.0]]), torch.tensor([3.0]),
        ...                torch.tensor([1.0]), False)[["edge", "normalized"]].values.tolist()
        [['y', 1.0], ['x', 0.0]]
    """
    gap = float(clean_R.mean() - corrupt_R.mean())
    if per_prompt:
        if values_nR.shape[1] != len(corrupt_R):
            raise InputError("per_prompt=True needs a metric with one value per prompt")
        n, R = values_nR.shape
        table = labels.loc[labels.index.repeat(R)].reset_index(drop=True)
        table["prompt"] = np.tile(np.arange(R), n)
        table["metric"] = values_nR.reshape(-1).numpy()
        table["delta"] = (values_nR - corrupt_R[None]).reshape(-1).numpy()
        table["normalized"] = ((values_nR - corrupt_R[None]) / (clean_R - corrupt_R)[None]).reshape(-1).numpy()
    else:
        table = labels.copy()
        table["metric"] = values_nR.mean(1).numpy()
        table["delta"] = table["metric"] - float(corrupt_R.mean())
        table["normalized"] = table["delta"] / gap if gap != 0 else np.nan
    table = table.iloc[np.argsort(-np.abs(table["delta"].to_numpy()), kind="stable")].reset_index(drop=True)
    table.attrs.update(clean_metric=float(clean_R.mean()), corrupt_metric=float(corrupt_R.mean()))
    return table
