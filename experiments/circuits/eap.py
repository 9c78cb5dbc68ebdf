"""Edge attribution patching (EAP, Syed et al. 2023) and its integrated-gradients form (EAP-IG, Hanna et al. 2024).

Legend: B batch, P position, O circuit writers, I circuit readers, D d_model.

The score of edge (w, r) at position p is TransformerLens's: (clean_w - corrupt_w)[p] . d metric / d input_r[p],
the gradient taken on the corrupted run (a positive score: moving the edge toward clean raises the metric), the
mean over pairs. EAP-IG averages that gradient over ``ig_steps`` runs whose input (the residual stream entering
block 0) is corrupt + alpha (clean - corrupt), alpha = k / ig_steps for k = 0 .. ig_steps - 1: one step is EAP,
and as the steps grow the scores of an edge whose effect is linear in its reader's input approach its exact
patching effect. Pairs run ``batch_size`` at a time, padded; pads score zero, so a padded batch gives the mean of
its pairs run alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from experiments._batched import metric_from_final_resid
from experiments._progress import Progress, ProgressArg
from experiments.circuits.graph import EMBED_HOOK, CircuitGraph, circuit_graph
from experiments.circuits.runs import base_run, edge_switches, reader_hooks, stack_writers
from experiments.gradients import capturing_gradients
from experiments.patching.pairs import PairedPrompts, takes_pairs
from workbench.errors import InputError

Method = Literal["eap", "eap-ig"]


@dataclass(frozen=True, eq=False)
class EdgeScores:
    """Edge scores [P, O, I] (or [prompt, P, O, I] per prompt), zero where no edge is, and the graph they belong to.

    Example:
        >>> from experiments.metrics import logit_diff
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> pairs = PairedPrompts.from_prompts(model, tokens, corrupt, answers=" s", wrong=" and")
        >>> scores = edge_attribution_patching(model, pairs)
        >>> scores.scores.shape                                # [pos, writers, readers]
        torch.Size([14, 9, 25])
        >>> scores.to_frame(positions="sum").columns.tolist()
        ['edge', 'writer', 'reader', 'score']
    """

    graph: CircuitGraph
    scores: Float[Tensor, "*prompt pos writers readers"]
    method: str
    attrs: dict = field(default_factory=dict)

    def summed(self) -> Float[Tensor, "*prompt writers readers"]:
        """The scores summed over positions: an edge patched at every position."""
        return self.scores.sum(-3)

    def to_frame(self, positions: Literal["each", "sum"] = "each") -> pd.DataFrame:
        """DataFrame[edge, writer, reader, (position), (prompt), score], every edge of the graph, strongest first.

        Example:
            >>> from experiments.metrics import logit_diff
            >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
            >>> scores = edge_attribution_patching(model, tokens, corrupt, logit_diff(model, " s", " and", 1))
            >>> top = scores.to_frame().iloc[0]                  # the largest |score|
            >>> top["edge"], int(top["position"])
            ('a1.h1->logits', 13)
        """
        if positions not in ("each", "sum"):
            raise InputError(f"positions must be 'each' or 'sum', got {positions!r}")
        values = self.summed()[..., None, :, :] if positions == "sum" else self.scores
        per_prompt = values.ndim == 4
        values = values if per_prompt else values[None]
        w, r = self.graph.edge_mask.nonzero(as_tuple=True)
        N, P = values.shape[:2]
        flat = values[:, :, w, r].float().cpu().numpy()  # [N, P, E]
        edges = np.array([f"{a}->{b}" for a, b in zip(np.array(self.graph.writers)[w.numpy()],
                                                      np.array(self.graph.readers)[r.numpy()])])
        E = len(edges)
        table = pd.DataFrame({"edge": np.tile(edges, N * P), "writer": np.tile(np.array(self.graph.writers)[w.numpy()], N * P),
                              "reader": np.tile(np.array(self.graph.readers)[r.numpy()], N * P)})
        if positions == "each":
            table["position"] = np.tile(np.repeat(np.arange(P), E), N)
        if per_prompt:
            table["prompt"] = np.repeat(np.arange(N), P * E)
        table["score"] = flat.reshape(-1)
        table = table.iloc[np.argsort(-np.abs(table["score"].to_numpy()), kind="stable")].reset_index(drop=True)
        table.attrs.update(method=self.method, **self.attrs)
        return table


@takes_pairs("circuits")
def edge_attribution_patching(model, pairs: PairedPrompts, *, method: Method = "eap", ig_steps: int = 5,
                              batch_size: int = 16, per_prompt: bool = False, progress: ProgressArg = False) -> EdgeScores:
    """Every edge's attribution score at every position, over a padded dataset of clean/corrupted pairs.

    ``pairs``: a ``PairedPrompts`` (``PairedPrompts.from_prompts``: texts, token ids or an ``IOIDataset``, whose
    metric defaults to logit[IO] - logit[S]); its metric a ``Metric`` or a callable ``(logits, tokens) -> [batch]``.
    The older form (``clean, corrupt=None, metric=None`` and the keywords ``clean_mask``, ``corrupt_mask``) is still
    taken. ``method="eap-ig"``
    integrates the gradient over ``ig_steps`` inputs from the corrupted end. Returns ``EdgeScores`` (the tensor,
    ``to_frame()`` the DataFrame), its attrs holding the clean and corrupted metric.

    Example:
        >>> from experiments.metrics import logit_diff
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> scores = edge_attribution_patching(model, tokens, corrupt, logit_diff(model, " s", " and", 1),
        ...                                    method="eap-ig", ig_steps=3)      # the older form
        >>> scores.method, round(scores.attrs["clean_metric"] - scores.attrs["corrupt_metric"], 2)
        ('eap-ig', 1.61)
    """
    if method not in ("eap", "eap-ig"):
        raise InputError(f"method must be 'eap' or 'eap-ig', got {method!r}")
    steps = 1 if method == "eap" else int(ig_steps)
    if steps < 1:
        raise InputError(f"ig_steps must be at least 1, got {ig_steps}")
    if batch_size < 1:
        raise InputError(f"batch_size must be at least 1, got {batch_size}")
    graph = circuit_graph(model)
    N = pairs.size
    chunks = [(start, min(start + batch_size, N)) for start in range(0, N, batch_size)]
    totals: list[Tensor] = []
    metrics = {"clean": [], "corrupt": []}
    with edge_switches(model), Progress(progress, total=len(chunks) * (steps + 1), desc="edge attribution") as bar:
        for start, stop in chunks:
            part = pairs.rows(start, stop)
            scores, clean_R, corrupt_R = _chunk_scores(model, graph, part, steps, N, per_prompt, bar)
            totals.append(scores)
            metrics["clean"].append(clean_R)
            metrics["corrupt"].append(corrupt_R)
    scores = torch.cat(totals) if per_prompt else torch.stack(totals).sum(0)
    clean_R, corrupt_R = torch.cat(metrics["clean"]), torch.cat(metrics["corrupt"])
    attrs = dict(clean_metric=float(clean_R.mean()), corrupt_metric=float(corrupt_R.mean()), ig_steps=steps, pairs=N)
    return EdgeScores(graph, scores * graph.edge_mask, method, attrs)


def _chunk_scores(model, graph: CircuitGraph, part: PairedPrompts, steps: int, N: int, per_prompt: bool,
                  bar: Progress) -> tuple[Tensor, Tensor, Tensor]:
    """This chunk's share of the mean score [P, O, I] (or each pair's own [B, P, O, I]), and its metrics."""
    with torch.no_grad():  # one clean pass gives the writers and, unembedding only what it reads, the metric
        clean_run = base_run(model, graph, part.clean)
        clean_values = clean_run.writers
        clean_R = metric_from_final_resid(model, clean_run.final, part.clean, part.metric)[0].float().cpu()
    bar.advance()
    corrupt_values: dict[str, Tensor] = {}
    grads: Optional[Tensor] = None
    corrupt_R = torch.zeros(0)
    for k in range(steps):
        step_grads, values_R = _reader_gradients(model, graph, part, clean_values[EMBED_HOOK], k / steps,
                                                 corrupt_values if k == 0 else None, N, per_prompt)
        grads = step_grads if grads is None else grads + step_grads
        if k == 0:
            corrupt_R = values_R
        bar.advance()
    delta = (stack_writers(graph, clean_values) - stack_writers(graph, corrupt_values)).float()
    delta = delta * part.scored[:, :, None, None].to(delta.device)
    pattern = "bpwd,bprd->bpwr" if per_prompt else "bpwd,bprd->pwr"
    return torch.einsum(pattern, delta, grads / steps).cpu(), clean_R, corrupt_R


def _reader_gradients(model, graph: CircuitGraph, part: PairedPrompts, clean_input: Tensor, alpha: float,
                      keep_writers: Optional[dict[str, Tensor]], N: int, per_prompt: bool) -> tuple[Tensor, Tensor]:
    """d objective / d every reader's input [B, P, I, D] on the corrupted run with its input moved ``alpha`` of the
    way to the clean one; the objective is each pair's metric (``per_prompt``) or its share of the mean over N."""
    def interpolate(resid: Tensor, hook) -> Tensor:
        if keep_writers is not None:
            keep_writers[hook.name] = resid.detach()
        return resid if alpha == 0 else resid + alpha * (clean_input - resid.detach())

    def record(activation: Tensor, hook) -> None:  # the corrupted run's writers, on the first step
        keep_writers[hook.name] = activation.detach()

    readers = reader_hooks(graph)
    hooks = [(EMBED_HOOK, interpolate)]
    if keep_writers is not None:
        hooks += [(name, record) for name in _output_hooks(graph)]
    with capturing_gradients(model, readers, fwd_hooks=hooks) as captured:
        final = model(part.corrupt.tokens, attention_mask=part.corrupt.mask, stop_at_layer=graph.n_layers)
        values_R = metric_from_final_resid(model, final, part.corrupt, part.metric)[0]
        B = part.size
        if len(values_R) == B:  # one value per pair: each pair's own gradient, or its share of the mean
            objective = values_R.sum() if per_prompt else values_R.sum() / N
        elif per_prompt:
            raise InputError("per_prompt=True needs a metric with one value per prompt; this one returns one value "
                             "for the whole batch")
        else:  # a batch-level value: this chunk's share of the mean over the chunks
            objective = values_R.sum() * B / N
        by_name = captured.gradients(objective)
    parts = []
    for layer in range(graph.n_layers):
        parts += [by_name[f"blocks.{layer}.hook_{kind}_input"] for kind in "qkv"]
        if graph.has_mlp:
            parts.append(by_name[f"blocks.{layer}.hook_mlp_in"][:, :, None])
    parts.append(by_name[f"blocks.{graph.n_layers - 1}.hook_resid_post"][:, :, None])
    return torch.cat(parts, dim=2).float().detach(), values_R.detach().float().cpu()


def _output_hooks(graph: CircuitGraph) -> list[str]:
    names = []
    for layer in range(graph.n_layers):
        names.append(f"blocks.{layer}.attn.hook_result")
        if graph.has_mlp:
            names.append(f"blocks.{layer}.hook_mlp_out")
    return names
