"""Figures of ``experiments.circuits``: the circuit drawn as a graph (layers as rows), the faithfulness curve, the
strongest edges.

Legend: O circuit writers, I circuit readers.
"""

from __future__ import annotations

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


def circuit_figure(circuit: Circuit, title: str = "") -> go.Figure:
    """The circuit as a graph: nodes where ``node_positions`` puts them, one line per edge (summed over positions),
    red where patching the edge toward clean raises the metric, blue where it lowers it, width by |score|; the edge
    and its reader input in the hover text.

    Example:
        >>> from experiments.circuits import circuit_graph
        >>> graph = circuit_graph(model)
        >>> fig = circuit_figure(Circuit(graph, graph.edges_mask(["a0.h0->a1.h1<k>", "a1.h1->logits"])))
        >>> len(fig.data)                                      # two edges, then the nodes
        3
    """
    graph = circuit.graph
    where = node_positions(graph)
    mask = circuit.mask if circuit.mask.ndim == 2 else circuit.mask.any(0)
    scores = None if circuit.scores is None else (circuit.scores if circuit.scores.ndim == 2 else circuit.scores.sum(0))
    edges = mask.nonzero().tolist()
    largest = max([abs(float(scores[w, r])) for w, r in edges] + [1e-12]) if scores is not None else 1.0
    fig = go.Figure()
    for w, r in edges:
        writer, reader = graph.writers[w], graph.readers[r]
        (x0, y0), (x1, y1) = where[writer], where[graph.node_of(reader)]
        value = float(scores[w, r]) if scores is not None else 1.0
        offset = {"<q>": -0.12, "<k>": 0.0, "<v>": 0.12}.get(reader[-3:], 0.0)  # q, k and v arrive side by side
        fig.add_trace(go.Scatter(x=[x0, x1 + offset], y=[y0 + 0.05, y1 - 0.12], mode="lines", showlegend=False,
                                 line=dict(width=1 + 5 * abs(value) / largest,
                                           color="rgba(200,40,40,0.7)" if value >= 0 else "rgba(40,80,200,0.7)"),
                                 hovertext=f"{writer}->{reader}: {value:.4g}", hoverinfo="text"))
    nodes = circuit.nodes
    fig.add_trace(go.Scatter(x=[where[n][0] for n in nodes], y=[where[n][1] for n in nodes], mode="markers+text",
                             text=nodes, textposition="top center", marker=dict(size=14, color="#444"),
                             showlegend=False, hoverinfo="text"))
    fig.update_layout(title=title or f"Circuit: {circuit.n_edges} edges ({100 * circuit.share:.1f}% of the graph)",
                      xaxis=dict(title="head (MLP on the right)", showgrid=False),
                      yaxis=dict(title="layer", tickmode="array", tickvals=list(range(-1, graph.n_layers + 1)),
                                 ticktext=["input"] + [str(l) for l in range(graph.n_layers)] + ["logits"]),
                      plot_bgcolor="white", height=max(400, 40 * graph.n_layers + 200))
    return fig


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
