"""Information flow: from a chosen token, the graph of attention edges and blocks that carry its
prediction (the contribution graph of llm-transparency-tool, "Information Flow Routes"), above an
adjustable importance threshold. Click an attention edge for the heads that carry it and their
patterns, or a node for what its block writes in vocabulary terms (promoted and suppressed tokens).

The inspected item defaults to the strongest attention edge between tokens that are not special (BOS, pad: the
BOS->BOS edge says little), unless the toggle brings special tokens back; the traced token and the inspected
item go back to their defaults when the prompt changes.
"""

from __future__ import annotations

from typing import Optional

import pandas as pd
import streamlit as st

from app import downloads, results, url_state
from app.safe_text import quoted
from app.results.flow import default_pick
from app.special_tokens import show_special_toggle, special_positions
from app.state import LoadedModel
from app.url_state import linked
from app.widgets import Prompt, click_keeper, page_setup, progress_callback, prompt_box, require_model, run_page
from experiments import flow
from experiments.plots.flow import flow_figure
from experiments.plots.attention import layer_patterns_figure

PICK_KEY, CHART_KEY = "flow_pick", "flow_graph"
CLICKED_KEY = "_flow_clicked"  # the graph item clicked last, applied to the "Inspect" box on the next run
TOP_HEADS_SHOWN = 3
VOCAB_K = 10
BLOCK_NAMES = {"attn": "attention", "mlp": "MLP"}


def _choices(prompt: Prompt) -> tuple[int, float]:
    n = len(prompt.ids)
    left, right = st.columns(2)
    with left:
        position = linked(st.selectbox, "Token whose prediction is traced", options=list(range(n)), index=n - 1,
                          format_func=lambda p: f"{p}: {prompt.str_tokens[p]!r}", key="flow_position")
    with right:
        threshold = linked(st.slider, "Importance threshold", min_value=0.01, max_value=0.5, value=flow.DEFAULT_THRESHOLD,
                           step=0.01, key="flow_threshold",
                           help="Edges whose share of their residual update is at least this are kept (the tool's "
                                "default is 0.04). Each update's parts share 1 between them.")
    return int(position), float(threshold)


def _summary(nodes: pd.DataFrame, edges: pd.DataFrame) -> None:
    with st.container(key="flow_metrics"):
        cols = st.columns(4)
        cols[0].metric("Nodes", len(nodes))
        cols[1].metric("Edges", len(edges))
        attention_edges = edges[edges["kind"] == "attention"]
        cols[2].metric("Attention edges", len(attention_edges))
        if len(attention_edges):
            top = attention_edges.iloc[0]
            cols[3].metric("Top attention edge", f"{top.importance:.4f}",
                           help=f"{top.edge} (heads: {top.heads})")


def _pick(nodes: pd.DataFrame, edges: pd.DataFrame, special: tuple[int, ...]) -> Optional[str]:
    """The node or edge to inspect: a select box, moved by clicks on the graph (default: the top attention edge
    between tokens that are not special)."""
    attention_edges = edges.loc[edges["kind"] == "attention", "edge"].tolist()
    options = attention_edges + nodes["node"].tolist() + edges.loc[edges["kind"] != "attention", "edge"].tolist()
    clicked = st.session_state.pop(CLICKED_KEY, None)
    if clicked in options:
        url_state.choose(PICK_KEY, clicked)
    return linked(st.selectbox, "Inspect (or click a node or an attention edge's midpoint in the graph)", options=options,
                  index=default_pick(edges, special), key=PICK_KEY)


def _edge_view(prompt: Prompt, contributions, edge: pd.Series) -> None:
    layer, i, j = int(edge.layer), int(edge.target_position), int(edge.source_position)
    st.markdown(f"**Attention edge at layer {layer}: {j} {quoted(repr(prompt.str_tokens[j]))} → {i} {quoted(repr(prompt.str_tokens[i]))}**, "
                f"importance {edge.importance:.4f}")
    heads = flow.edge_heads(contributions, layer, i, j)
    downloads.table(heads, f"flow_edge_heads_L{layer}_{j}_{i}", key="flow_edge_heads", height=200)
    patterns_LHPS = contributions.patterns_LHPS  # from the contributions' own forward: no second one
    shown = heads.head(TOP_HEADS_SHOWN)
    numbers = [int(h) for h in shown["head"]]
    # The strongest heads' patterns, strongest first, as tiles of one figure: three figures took 0.08-0.13 s more of
    # a prompt change in Chromium than one did (issue 52).
    fig = layer_patterns_figure(patterns_LHPS[layer, numbers], prompt.str_tokens, layer, heads=numbers,
                                tile_titles=[f"L{layer}H{h} (carries {share:.3f})" for h, share in
                                             zip(numbers, shown["importance"])],
                                title=f"The heads that carry the edge, at layer {layer}")
    downloads.figure(fig, f"flow_patterns_L{layer}_{j}_{i}", key="flow_patterns")


def _node_view(loaded: LoadedModel, prompt: Prompt, node: pd.Series) -> None:
    layer, position, block = int(node.layer), int(node.position), node.block
    if not block:
        st.info(f"{node.node} is the embedding of token {position} {quoted(repr(prompt.str_tokens[position]))}: no block writes it.")
        return
    st.markdown(f"**{node.node}: what layer {layer}'s {BLOCK_NAMES[block]} writes at {position} "
                f"{quoted(repr(prompt.str_tokens[position]))}**")
    st.caption("Its output through the final norm (scale frozen at this position's final residual) and the "
               "unembedding: its direct effect on this position's logits.")
    vocab = results.flow_vocab_projection(loaded, prompt.ids, layer, position, block, VOCAB_K)
    left, right = st.columns(2)
    for column, direction in ((left, "promoted"), (right, "suppressed")):
        with column:
            st.markdown(f"*{direction.capitalize()}*")
            downloads.table(vocab[vocab["direction"] == direction], f"flow_{direction}_L{layer}_{block}_{position}",
                            key=f"flow_{direction}")


def _detail(loaded: LoadedModel, prompt: Prompt, contributions, nodes: pd.DataFrame, edges: pd.DataFrame,
            picked: str) -> None:
    with st.container(key="flow_detail"):
        if picked in set(edges["edge"]):
            edge = edges[edges["edge"] == picked].iloc[0]
            if edge.kind == "attention":
                _edge_view(prompt, contributions, edge)
                return
            picked = edge.source if edge.kind == "mlp_in" else edge.target  # a block's edge: the block it touches
        _node_view(loaded, prompt, nodes[nodes["node"] == picked].iloc[0])


def main() -> None:
    st.title("Information flow")
    loaded = require_model()
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    include = show_special_toggle("the default inspected edge")
    special = () if include else special_positions(loaded.model, prompt.ids)
    # A token or an edge picked on another prompt gives way to this one's default.
    url_state.follow("flow", prompt.ids, "flow_position", PICK_KEY)
    url_state.follow("flow_special", include, PICK_KEY)
    position, threshold = _choices(prompt)
    contributions = results.flow_contributions(loaded, prompt.ids, bar=progress_callback)
    nodes, edges = flow.flow_graph(contributions, position, threshold)
    _summary(nodes, edges)
    st.caption("Nodes are residual states (circles: embeddings, after attention, after the block) and MLP blocks "
               "(squares); edges are attention (blue, a token read by another), residual (grey) and MLP (orange), "
               "wider and darker with their importance. Hover an attention edge's midpoint for the heads that carry it.")
    title = f"Information flow into {position} {prompt.str_tokens[position]!r} (importance ≥ {threshold:.2f})"
    downloads.figure(flow_figure(nodes, edges, prompt.str_tokens, contributions.n_layers, title),
                     "information_flow", key=CHART_KEY, stretch=False,
                     on_select=click_keeper(CHART_KEY, CLICKED_KEY, str))
    picked = _pick(nodes, edges, special)
    if picked is not None:
        _detail(loaded, prompt, contributions, nodes, edges, picked)
    # Filled only when opened (opening it reruns the page): closed, it still sent both tables (the largest part of
    # a 64-token prompt change's 0.55-0.7 MB to the browser).
    tables = st.expander("Edges and nodes as tables", key="flow_tables_open", on_change="rerun")
    if tables.open:
        with tables:
            downloads.table(edges, "information_flow_edges", key="flow_edges", height=300)
            downloads.table(nodes, "information_flow_nodes", key="flow_nodes", height=250)


page_setup("Information flow")
run_page(main)
