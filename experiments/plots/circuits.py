"""Figures of ``experiments.circuits``: the circuit drawn as a graph (layers as rows), the faithfulness curve, the
strongest edges.

Legend: O circuit writers, I circuit readers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from experiments.circuits.circuit import Circuit
from experiments.circuits.graph import CircuitGraph


def node_positions(graph: CircuitGraph) -> dict[str, tuple[float, float]]:
    """(x, y) of every component: ``input`` at the bottom, layer l's heads (x = head) and MLP (x = n_heads) on row l,
    ``logits`` on top.

    Example:
        >>> from experiments.circuits import circuit_graph
        >>> node_positions(circuit_graph(model))["a1.h2"], node_positions(circuit_graph(model))["logits"]
        ((2.0, 1.0), (1.5, 2.0))
    """
    middle = (graph.n_heads - 1) / 2
    positions = {"input": (middle, -1.0), "logits": (middle, float(graph.n_layers))}
    for layer in range(graph.n_layers):
        for head in range(graph.n_heads):
            positions[f"a{layer}.h{head}"] = (float(head), float(layer))
        if graph.has_mlp:
            positions[f"m{layer}"] = (float(graph.n_heads), float(layer))
    return positions


@dataclass(frozen=True)
class CircuitDrawing:
    """A drawn circuit: the figure, the edges drawn (strongest |score| first), the nodes they join, how many of the
    circuit's edges passed ``min_score`` and the absolute cutoff that was."""

    figure: go.Figure
    edges: list[str]
    nodes: list[str]
    n_above: int
    cutoff: float


WIDTH_BINS = 3  # edge widths drawn: one line trace per sign and bin keeps the trace count bounded


def circuit_drawing(circuit: Circuit, min_score: float = 0.0, max_nodes: Optional[int] = None,
                    max_edges: Optional[int] = None, selected: Optional[str] = None, title: str = "") -> CircuitDrawing:
    """The circuit as a graph with a bounded payload: the edges whose |score| is at least ``min_score`` of the
    largest, strongest first, at most ``max_edges`` of them and only while their nodes number at most ``max_nodes``.
    Nodes sit where ``node_positions`` puts them; edges are lines (summed over positions) red where patching the
    edge toward clean raises the metric, blue where it lowers it, in ``WIDTH_BINS`` widths by |score|; a marker at
    each edge's middle carries the edge's name as ``customdata`` (a click reports it) and its score in the hover;
    ``selected`` is drawn larger.

    Example:
        >>> from experiments.circuits import circuit_graph
        >>> graph = circuit_graph(model)
        >>> mask = graph.edges_mask(["a0.h0->a1.h1<k>", "a1.h1->logits", "input->logits"])
        >>> scores = torch.zeros(mask.shape)
        >>> scores[graph.edge_index("a0.h0->a1.h1<k>")], scores[graph.edge_index("a1.h1->logits")] = 2.0, -1.0
        >>> scores[graph.edge_index("input->logits")] = 0.5
        >>> drawing = circuit_drawing(Circuit(graph, mask, scores * mask), min_score=0.4)
        >>> drawing.edges, drawing.nodes, drawing.n_above, drawing.cutoff
        (['a0.h0->a1.h1<k>', 'a1.h1->logits'], ['a0.h0', 'a1.h1', 'logits'], 2, 0.8)
        >>> circuit_drawing(Circuit(graph, mask, scores * mask), max_nodes=2).edges   # a third node would not fit
        ['a0.h0->a1.h1<k>']
    """
    graph = circuit.graph
    where = node_positions(graph)
    mask = circuit.mask if circuit.mask.ndim == 2 else circuit.mask.any(0)
    values = (circuit.scores if circuit.scores.ndim == 2 else circuit.scores.sum(0)) if circuit.scores is not None \
        else mask.float()
    pairs = mask.nonzero().tolist()
    magnitude = [abs(float(values[w, r])) for w, r in pairs]
    largest = max(magnitude + [0.0])
    cutoff = min_score * largest
    order = sorted((i for i in range(len(pairs)) if magnitude[i] >= cutoff and magnitude[i] > 0 or largest == 0),
                   key=lambda i: -magnitude[i])
    drawn: list[tuple[int, int]] = []
    nodes: set[str] = set()
    for i in order:
        w, r = pairs[i]
        ends = {graph.writers[w], graph.node_of(graph.readers[r])}
        if max_edges is not None and len(drawn) >= max_edges:
            break
        if max_nodes is not None and len(nodes | ends) > max_nodes:
            continue
        drawn.append((w, r))
        nodes |= ends
    fig = go.Figure()
    ends_of = {}
    for w, r in drawn:
        (x0, y0), (x1, y1) = where[graph.writers[w]], where[graph.node_of(graph.readers[r])]
        offset = {"<q>": -0.12, "<k>": 0.0, "<v>": 0.12}.get(graph.readers[r][-3:], 0.0)  # q, k, v side by side
        ends_of[w, r] = (x0, y0 + 0.05, x1 + offset, y1 - 0.12)
    for sign, color in ((1, "rgba(200,40,40,0.7)"), (-1, "rgba(40,80,200,0.7)")):
        for b in range(WIDTH_BINS):
            xs, ys = [], []
            for w, r in drawn:
                value = float(values[w, r])
                level = min(WIDTH_BINS - 1, int(WIDTH_BINS * abs(value) / max(largest, 1e-12)))
                if (value >= 0) == (sign > 0) and level == b:
                    x0, y0, x1, y1 = ends_of[w, r]
                    xs += [x0, x1, None]
                    ys += [y0, y1, None]
            if xs:
                fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False,
                                         line=dict(width=1 + 2.5 * b, color=color)))
    names = [graph.edge_name(w, r) for w, r in drawn]
    fig.add_trace(go.Scatter(
        x=[(ends_of[e][0] + ends_of[e][2]) / 2 for e in drawn], y=[(ends_of[e][1] + ends_of[e][3]) / 2 for e in drawn],
        mode="markers", name="edges", customdata=names, hoverinfo="text",
        hovertext=[f"{name}: {float(values[w, r]):.4g}" for name, (w, r) in zip(names, drawn)],
        marker=dict(size=[13 if name == selected else 7 for name in names], symbol="diamond",
                    color=["#c82828" if float(values[w, r]) >= 0 else "#2850c8" for w, r in drawn],
                    line=dict(color="black", width=[2 if name == selected else 0 for name in names]))))
    shown = [name for name in graph.writers + ["logits"] if name in nodes]
    fig.add_trace(go.Scatter(x=[where[n][0] for n in shown], y=[where[n][1] for n in shown], mode="markers+text",
                             text=shown, textposition="top center", marker=dict(size=14, color="#444"),
                             name="nodes", hoverinfo="text", hovertext=shown))
    fig.update_layout(title=title or f"Circuit: {circuit.n_edges} edges ({100 * circuit.share:.1f}% of the graph)",
                      xaxis=dict(title="head (MLP on the right)", showgrid=False),
                      yaxis=dict(title="layer", tickmode="array", tickvals=list(range(-1, graph.n_layers + 1)),
                                 ticktext=["input"] + [str(l) for l in range(graph.n_layers)] + ["logits"]),
                      plot_bgcolor="white", height=max(400, 40 * graph.n_layers + 200), showlegend=False,
                      clickmode="event+select")
    return CircuitDrawing(fig, names, shown, len(order), cutoff)


def circuit_figure(circuit: Circuit, title: str = "") -> go.Figure:
    """The whole circuit drawn by ``circuit_drawing`` (every edge, no cap): the command's HTML figure.

    Example:
        >>> from experiments.circuits import circuit_graph
        >>> graph = circuit_graph(model)
        >>> fig = circuit_figure(Circuit(graph, graph.edges_mask(["a0.h0->a1.h1<k>", "a1.h1->logits"])))
        >>> list(fig.data[-2].customdata), list(fig.data[-1].text)        # the edges' markers, then the nodes
        (['a0.h0->a1.h1<k>', 'a1.h1->logits'], ['a0.h0', 'a1.h1', 'logits'])
    """
    return circuit_drawing(circuit, title=title).figure


def faithfulness_curve_figure(curve: pd.DataFrame, title: str = "Faithfulness curve") -> go.Figure:
    """The share of the clean - corrupt gap recovered against the share of edges kept (log x).

    Example:
        >>> fig = faithfulness_curve_figure(pd.DataFrame({"n_edges": [1, 10], "share": [0.01, 0.1], "recovered": [0.2, 0.9]}))
        >>> fig.data[0].y.tolist()
        [0.2, 0.9]
    """
    fig = go.Figure(go.Scatter(x=curve["share"], y=curve["recovered"], mode="lines+markers",
                               hovertext=[f"{n} edges" for n in curve["n_edges"]]))
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(title=title, xaxis=dict(title="share of edges kept", type="log"),
                      yaxis=dict(title="share of the clean - corrupt gap recovered"))
    return fig


def edge_bars(table: pd.DataFrame, top: int = 30, value: str = "score", title: str = "Strongest edges") -> go.Figure:
    """Horizontal bars of the ``top`` edges of an edge table by |value|.

    Example:
        >>> len(edge_bars(pd.DataFrame({"edge": ["a->b", "c->d"], "score": [0.5, -1.0]})).data[0].y)
        2
    """
    rows = table.iloc[np.argsort(-np.abs(table[value].to_numpy()), kind="stable")[:top]][::-1]
    label = rows["edge"] + (("@" + rows["position"].astype(str)) if "position" in rows else "")
    fig = go.Figure(go.Bar(x=rows[value], y=label, orientation="h",
                           marker_color=np.where(rows[value] >= 0, "#c82828", "#2850c8")))
    fig.update_layout(title=title, xaxis_title=value, height=max(300, 18 * len(rows) + 120))
    return fig
