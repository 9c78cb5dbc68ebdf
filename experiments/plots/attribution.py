"""An attribution graph drawn with plotly, with a bounded payload whatever the graph's size.

Rows are layers (tokens at the bottom, logits at the top), columns prompt positions; nodes sharing a cell are spread
across it. Only the pruned graph is drawn, and of it at most ``max_nodes`` nodes (the logits, the pinned nodes, then
the most influential) and ``max_edges`` edges among them (the largest by absolute weight), so a graph of any size
sends the browser a figure of bounded size; ``GraphDrawing`` says how many were left out. Token text is escaped
for plotly (``chart_text``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import plotly.graph_objects as go
import torch

from experiments._tokens import chart_text
from experiments.attribution.graph import AttributionGraph
from experiments.attribution.influence import PruneResult

KIND_STYLE = {"feature": ("#1f77b4", "circle"), "error": ("#7f7f7f", "square"), "token": ("#2ca02c", "diamond"),
              "logit": ("#d62728", "star")}


def node_kind(graph: AttributionGraph, index: int) -> str:
    """``feature``, ``error``, ``token`` or ``logit``: what node ``index`` of the adjacency is.

    Example:
        >>> g = AttributionGraph("a", torch.tensor([1, 2]), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0),
        ...     torch.zeros(0, dtype=torch.long), torch.zeros(5, 5), torch.tensor([3]), torch.ones(1), 1, 4)
        >>> [node_kind(g, i) for i in range(5)]
        ['error', 'error', 'token', 'token', 'logit']
    """
    n_features, n_pos = len(graph.selected_features), graph.n_pos
    if index < n_features:
        return "feature"
    if index < n_features + graph.n_layers * n_pos:
        return "error"
    return "token" if index < n_features + (graph.n_layers + 1) * n_pos else "logit"


def node_place(graph: AttributionGraph, index: int) -> tuple[int, int, Optional[int]]:
    """``(row, position, feature)`` of node ``index``: row 0 the tokens, ``layer + 1`` a layer's features and errors,
    ``n_layers + 1`` the logits; ``feature`` the transcoder feature (None for other nodes).

    Example:
        >>> g = AttributionGraph("a", torch.tensor([1, 2]), torch.tensor([[0, 1, 7]]), torch.ones(1),
        ...     torch.tensor([0]), torch.zeros(6, 6), torch.tensor([3]), torch.ones(1), 1, 4)
        >>> node_place(g, 0), node_place(g, 3), node_place(g, 5)
        ((1, 1, 7), (0, 0, None), (2, 1, None))
    """
    n_features, n_pos = len(graph.selected_features), graph.n_pos
    kind = node_kind(graph, index)
    if kind == "feature":
        layer, pos, feature = graph.active_features[int(graph.selected_features[index])].tolist()
        return layer + 1, pos, feature
    if kind == "error":
        layer, pos = divmod(index - n_features, n_pos)
        return layer + 1, pos, None
    if kind == "token":
        return 0, index - n_features - graph.n_layers * n_pos, None
    return graph.n_layers + 1, n_pos - 1, None


def node_labels(graph: AttributionGraph) -> list[str]:
    """A plain-text label per node: ``L1 F7 @3``, ``error L0 @2``, ``token @4 ' cat'``, ``logit ' mat' (p=0.412)``.

    Example:
        >>> g = AttributionGraph("a", torch.tensor([1, 2]), torch.tensor([[0, 1, 7]]), torch.ones(1),
        ...     torch.tensor([0]), torch.zeros(6, 6), torch.tensor([3]), torch.ones(1), 1, 4, ["x"], ["<b>", "a"])
        >>> node_labels(g)
        ['L0 F7 @1', 'error L0 @0', 'error L0 @1', "token @0 '<b>'", "token @1 'a'", "logit 'x' (p=1.000)"]
    """
    labels = []
    n_logit_start = graph.n_nodes - len(graph.logit_token_ids)
    for index in range(graph.n_nodes):
        kind = node_kind(graph, index)
        row, pos, feature = node_place(graph, index)
        if kind == "feature":
            labels.append(f"L{row - 1} F{feature} @{pos}")
        elif kind == "error":
            labels.append(f"error L{row - 1} @{pos}")
        elif kind == "token":
            text = graph.input_token_strings[pos] if pos < len(graph.input_token_strings) else str(int(graph.input_tokens[pos]))
            labels.append(f"token @{pos} {text[:20]!r}")
        else:
            rank = index - n_logit_start
            text = graph.logit_token_strings[rank] if rank < len(graph.logit_token_strings) else str(int(graph.logit_token_ids[rank]))
            labels.append(f"logit {text[:20]!r} (p={float(graph.logit_probabilities[rank]):.3f})")
    return labels


@dataclass
class GraphDrawing:
    """The figure and what it leaves out: ``nodes`` drawn (adjacency indices), of ``n_kept_nodes`` the pruning kept;
    ``n_edges`` drawn of ``n_kept_edges``."""

    figure: go.Figure
    nodes: list[int]
    n_kept_nodes: int
    n_edges: int
    n_kept_edges: int


def graph_figure(graph: AttributionGraph, pruned: PruneResult, max_nodes: int = 150, max_edges: int = 400,
                 selected: Optional[int] = None, pinned: Sequence[int] = (), only: Optional[Sequence[int]] = None,
                 title: str = "") -> GraphDrawing:
    """The pruned graph (or the nodes ``only``) as a plotly figure, at most ``max_nodes`` nodes and ``max_edges``
    edges; each node's ``customdata`` is its adjacency index (a click reports it).

    Example:
        >>> g = AttributionGraph("a", torch.tensor([1, 2]), torch.tensor([[0, 1, 7]]), torch.ones(1),
        ...     torch.tensor([0]), torch.zeros(6, 6), torch.tensor([3]), torch.ones(1), 1, 4)
        >>> g.adjacency_matrix[5, 0], g.adjacency_matrix[0, 4] = 2.0, 1.0
        >>> from experiments.attribution import prune_graph
        >>> drawing = graph_figure(g, prune_graph(g), max_nodes=3)
        >>> drawing.nodes, drawing.n_kept_nodes, drawing.n_edges
        ([5, 0, 3], 4, 1)
    """
    kept = pruned.node_mask.nonzero().flatten().tolist() if only is None else sorted(set(only))
    logits = [i for i in kept if node_kind(graph, i) == "logit"]
    first = logits + [i for i in pinned if i in kept and i not in logits]
    by_influence = sorted((i for i in kept if i not in first), key=lambda i: float(pruned.cumulative_scores[i]))
    nodes = (first + by_influence)[:max_nodes]
    chosen = torch.tensor(nodes, dtype=torch.long)
    weights = graph.adjacency_matrix[chosen][:, chosen]
    mask = pruned.edge_mask[chosen][:, chosen] if only is None else weights != 0
    targets, sources = mask.nonzero(as_tuple=True)
    order = weights[targets, sources].abs().argsort(descending=True)[:max_edges]
    places = _spread(graph, nodes)
    fig = go.Figure()
    for sign, color in ((1, "rgba(31,119,180,0.45)"), (-1, "rgba(214,39,40,0.45)")):
        xs, ys = [], []
        for k in order.tolist():
            t, s = int(targets[k]), int(sources[k])
            if (weights[t, s] > 0) == (sign > 0):
                xs += [places[nodes[s]][0], places[nodes[t]][0], None]
                ys += [places[nodes[s]][1], places[nodes[t]][1], None]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(color=color, width=1), hoverinfo="skip",
                                 name="positive edges" if sign > 0 else "negative edges"))
    labels = node_labels(graph)
    for kind, (color, symbol) in KIND_STYLE.items():
        members = [i for i in nodes if node_kind(graph, i) == kind]
        if not members:
            continue
        fig.add_trace(go.Scatter(
            x=[places[i][0] for i in members], y=[places[i][1] for i in members], mode="markers", name=kind,
            marker=dict(color=color, symbol=symbol, size=[16 if i == selected else 11 if i in pinned else 8 for i in members],
                        line=dict(color="black", width=[3 if i == selected else 1 if i in pinned else 0 for i in members])),
            customdata=members, hovertext=[chart_text(labels[i]) for i in members], hoverinfo="text"))
    tokens = [chart_text(f"{p}: {t[:12]!r}") for p, t in enumerate(graph.input_token_strings or
                                                                   [str(int(t)) for t in graph.input_tokens])]
    fig.update_layout(
        title=title, height=200 + 60 * (graph.n_layers + 2),
        xaxis=dict(tickmode="array", tickvals=list(range(graph.n_pos)), ticktext=tokens, title="position"),
        yaxis=dict(tickmode="array", tickvals=list(range(graph.n_layers + 2)),
                   ticktext=["tokens"] + [f"layer {l}" for l in range(graph.n_layers)] + ["logits"]))
    return GraphDrawing(fig, nodes, len(kept), len(order), int(mask.sum()))


def _spread(graph: AttributionGraph, nodes: Sequence[int]) -> dict[int, tuple[float, float]]:
    """Each node's (x, y): its position and row, nodes sharing a cell spread across 0.8 of it."""
    cells: dict[tuple[int, int], list[int]] = defaultdict(list)
    for index in nodes:
        row, pos, _ = node_place(graph, index)
        cells[row, pos].append(index)
    places: dict[int, tuple[Any, Any]] = {}
    for (row, pos), members in cells.items():
        for k, index in enumerate(members):
            offset = 0.0 if len(members) == 1 else -0.4 + 0.8 * k / (len(members) - 1)
            places[index] = (pos + offset, row)
    return places
