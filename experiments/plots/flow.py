"""The figure of ``experiments.flow``: the information-flow graph, positions across and layers up.

Legend: P position.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from experiments._tokens import axis_labels, chart_text, token_label

# Edge kinds drawn alike share their line traces (each trace costs plotly.js about 1.5 ms a redraw in Chromium):
# an edge's kind names its line group, the group its colour.
_LINE_GROUP = {"attention": "attention", "residual": "residual", "mlp_in": "mlp", "mlp": "mlp"}
EDGE_COLOURS = {"attention": "#2b6cb0", "residual": "#8c8c8c", "mlp": "#dd6b20"}
NODE_COLOURS = {"embed": "#4a5568", "mid": "#2b6cb0", "post": "#2f855a", "mlp": "#dd6b20"}
_WIDTH_BINS = np.array([0.1, 0.25, 0.5, 0.75])  # importance bins, each drawn as one line trace


def _node_xy(nodes: pd.DataFrame, parallel_or_attn_only: bool) -> tuple[np.ndarray, np.ndarray]:
    """Where each node is drawn: x its position (MLP nodes a little to the right), y its depth in layers.

    embed at 0, the state after layer l at l + 1; after attention at l + 0.5, MLP nodes at l + 0.75
    (l + 0.5 when attention and MLP read the same input or there is no ``mid`` state).

    Example:
        >>> _node_xy(pd.DataFrame({"stage": ["embed", "mid", "mlp"], "layer": [-1, 0, 0], "position": [2, 2, 2]}), False)
        (array([2.  , 2.  , 2.35]), array([0.  , 0.5 , 0.75]))
    """
    stage, layer = nodes["stage"].to_numpy(), nodes["layer"].to_numpy().astype(float)
    x = nodes["position"].to_numpy().astype(float) + np.where(stage == "mlp", 0.35, 0.0)
    mlp_y = layer + (0.5 if parallel_or_attn_only else 0.75)
    y = np.select([stage == "embed", stage == "mid", stage == "post"],
                  [np.zeros_like(layer), layer + 0.5, layer + 1.0], mlp_y)
    return x, y


def flow_figure(nodes: pd.DataFrame, edges: pd.DataFrame, str_toks: Sequence[str], n_layers: int,
                title: str = "Information flow") -> go.Figure:
    """The graph: positions across (token labels), layers up; edge width and opacity by importance.

    Nodes carry their id and attention edges' midpoints their edge id as ``customdata`` (click targets).

    Example:
        >>> from experiments.flow import flow_contributions, flow_graph
        >>> contributions = flow_contributions(model, tokens)
        >>> nodes, edges = flow_graph(contributions, -1, 0.04)
        >>> fig = flow_figure(nodes, edges, contributions.str_tokens, contributions.n_layers)
        >>> fig.data[-1].name, len(fig.data[-1].customdata) == len(nodes)   # the node trace: one marker a node
        ('nodes', True)
    """
    compact = not (nodes["stage"] == "mid").any()  # a sequential MLP node always comes with its mid state
    x, y = _node_xy(nodes, compact)
    where = dict(zip(nodes["node"], zip(x, y)))
    # Traces as plain dicts of arrays, the figure unvalidated: plotly's validation of every point of every trace was
    # 40-60 ms of a 64-token prompt change on the Information flow page. Lines break at NaN, as at None.
    traces = []
    bins = np.digitize(edges["importance"].to_numpy(), _WIDTH_BINS)
    for (line_group, b), group in edges.groupby([edges["kind"].map(_LINE_GROUP), bins], sort=True):
        xs, ys = [], []
        for kind, source, target in zip(group["kind"], group["source"], group["target"]):
            (x0, y0), (x1, y1) = where[source], where[target]
            if kind == "attention" and x0 == x1:  # a self edge, bent beside the residual one
                xs += [x0, x0 + 0.18, x1, np.nan]
                ys += [y0, (y0 + y1) / 2, y1, np.nan]
            else:
                xs += [x0, x1, np.nan]
                ys += [y0, y1, np.nan]
        traces.append(dict(type="scatter", x=np.array(xs), y=np.array(ys), mode="lines", hoverinfo="skip",
                           showlegend=False, name=line_group, opacity=0.3 + 0.15 * b,
                           line=dict(color=EDGE_COLOURS[line_group], width=1 + 2.5 * b)))
    # A marker at each attention edge's midpoint: its hover names the heads that carry it, a click inspects it. A
    # residual or MLP edge has none: clicking its block's node inspects the same block, and on SmolLM2 at 64 tokens
    # their ~1,000 markers were most of the browser's drawing of this figure.
    attention = edges[edges["kind"] == "attention"]
    mid_x, mid_y = [], []
    for source, target in zip(attention["source"], attention["target"]):
        (x0, y0), (x1, y1) = where[source], where[target]
        mid_x.append((x0 + x1) / 2 + (0.18 if x0 == x1 else 0.0))
        mid_y.append((y0 + y1) / 2)
    hover = [f"{e}<br>importance {v:.3f}" + (f"<br>{h}" if h else "")
             for e, v, h in zip(attention["edge"], attention["importance"], attention["heads"])]
    traces.append(dict(type="scatter", x=np.array(mid_x, dtype=float), y=np.array(mid_y, dtype=float),
                       mode="markers", name="edges", customdata=attention["edge"].tolist(), text=hover,
                       marker=dict(size=7, color=EDGE_COLOURS["attention"], opacity=0.35),
                       hovertemplate="%{text}<extra></extra>", showlegend=False))
    labels = [f"{chart_text(n)}<br>{token_label(t)}" for n, t in zip(nodes["node"], nodes["token"])]
    traces.append(dict(type="scatter", x=x, y=y, mode="markers", name="nodes", customdata=nodes["node"].tolist(),
                       # no outline: stroking each of ~900 markers (SmolLM2, 64 tokens) was a sixth of the figure's
                       # drawing in Chromium
                       marker=dict(size=11, color=[NODE_COLOURS[s] for s in nodes["stage"]],
                                   symbol=["square" if s == "mlp" else "circle" for s in nodes["stage"]]),
                       text=labels, hovertemplate="%{text}<extra></extra>", showlegend=False))
    P = len(str_toks)
    layout = dict(
        title=dict(text=title), height=max(450, 42 * n_layers + 220), width=max(650, 48 * P + 220),
        plot_bgcolor="white",
        xaxis=dict(tickmode="array", tickvals=list(range(P)), ticktext=axis_labels(list(str_toks)), tickangle=-60,
                   range=[-0.7, P - 0.3], title=dict(text="position")),
        yaxis=dict(tickmode="array", tickvals=list(range(n_layers + 1)),
                   ticktext=["embed"] + [f"L{l}" for l in range(n_layers)], range=[-0.4, n_layers + 0.4],
                   title=dict(text="residual stream after layer")),
    )
    return go.Figure(data=traces, layout=layout, _validate=False)
