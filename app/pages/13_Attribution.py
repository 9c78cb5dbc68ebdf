"""Attribution graph: trace the prompt's next-token prediction through transcoder features (circuit tracing) —
the pruned graph drawn with a bounded number of nodes and edges, a feature's card (the Features page's view), the
heads that carry its strongest incoming edge, pinned nodes as a subgraph, and an intervention on the feature with
the top logits before and after.
"""

from __future__ import annotations

from typing import Optional

import streamlit as st

import workbench as wb
from app import downloads, feature_card, results, url_state
from app.artifact_picker import open_artifact
from app.results.attribution import LoadedTranscoders, Settings, attribution_plan
from app.safe_text import quoted
from app.state import LoadedModel
from app.url_state import linked
from app.widgets import (Prompt, click_keeper, page_setup, progress_callback, prompt_box, require_model,
                         run_page)

PREFIX = "attribution"  # the feature card's widget keys (app.feature_card)
NODE_KEY, PIN_KEY, CHART_KEY = "attribution_node", "attribution_pinned", "attribution_graph"
MAX_NODES, MAX_EDGES = 150, 400  # what the drawing sends the browser, whatever the graph's size
TOP_LOGITS = 10
# Feature nodes by default: the most influential (circuit-tracer's order), so a real model's graph (SmolLM2 with its
# shipped transcoders: thousands of active features on the default prompt) is traced in seconds on a CPU; a toy's
# graph, with fewer active features, is whole. 0 in the box: every active feature.
DEFAULT_FEATURE_NODES = 200
INTERVENTIONS = {"Scale the activation by": "scale", "Set the activation to": "set"}
_CLICKED = "_attribution_clicked"   # the node clicked last, applied to the select box on the next run


def _choose_transcoders(loaded: LoadedModel) -> Optional[LoadedTranscoders]:
    """The transcoder set chosen (a shipped one or a path read only after a click), loaded and checked."""
    held = open_artifact(loaded, "transcoders")  # the one picker: shipped sets first, a path only after a click
    if held is None:
        return None
    loaded_tc = LoadedTranscoders(held.artifact, held.key)
    problem = results.fit_transcoders_error(loaded, loaded_tc)
    if problem is not None:
        st.error(f"These transcoders do not fit the open model: {quoted(problem, limit=400)}")
        return None
    st.caption(quoted(repr(loaded_tc.transcoders), limit=300))
    return loaded_tc


def _settings() -> tuple[Settings, float, float]:
    cols = st.columns(5)
    with cols[0]:
        n_logits = linked(st.number_input, "Logit nodes (max)", min_value=1, max_value=50, value=10, step=1,
                          key="attribution_max_logits")
    with cols[1]:
        prob = linked(st.number_input, "Logit probability covered", min_value=0.05, max_value=1.0, value=0.95,
                      step=0.05, key="attribution_logit_prob")
    with cols[2]:
        max_features = linked(st.number_input, "Feature nodes (0: all)", min_value=0, max_value=100_000,
                              value=DEFAULT_FEATURE_NODES,
                              step=100, key="attribution_max_features",
                              help="Above this many active features, only the most influential become nodes.")
    with cols[3]:
        node_threshold = linked(st.slider, "Node threshold", min_value=0.1, max_value=1.0, value=0.8, step=0.01,
                                key="attribution_node_threshold")
    with cols[4]:
        edge_threshold = linked(st.slider, "Edge threshold", min_value=0.1, max_value=1.0, value=0.98, step=0.01,
                                key="attribution_edge_threshold")
    return (int(n_logits), float(prob), int(max_features), 256), float(node_threshold), float(edge_threshold)


def _within_budget(loaded, loaded_tc, prompt: Prompt, settings: Settings) -> bool:
    """Whether the graph of these settings fits the page's budget (``results.attribution_plan``, before anything is
    allocated); over it, says so and offers the largest "Feature nodes" setting that fits."""
    try:
        plan = attribution_plan(loaded, loaded_tc, prompt.ids, settings)
    except wb.InputError as error:
        st.error(f"Cannot attribute this prompt: {quoted(error, limit=400)}")
        return False
    if plan.within:
        return True
    planned, budget = plan.sizes()
    over = (f"This graph could take {planned} (its adjacency and the forward pass's copies of the prompt, if every "
            f"transcoder feature fired), over the page's budget of {budget}; it is not built.")
    if not plan.feature_nodes:
        st.warning(f"{over} Shorten the prompt: even one feature node does not fit.")
        return False
    st.warning(f"{over} At most {plan.feature_nodes} feature nodes fit (only the most influential become nodes).")
    if st.button(f"Use {plan.feature_nodes} feature nodes", key="attribution_fit_budget"):
        url_state.choose("attribution_max_features", plan.feature_nodes)
        st.rerun()
    return False


def _graph_view(loaded, loaded_tc, prompt: Prompt, settings: Settings, thresholds: tuple[float, float],
                labels: list[str], kept: list[int], feature_nodes: list[int]) -> tuple[Optional[int], list[int]]:
    """The drawing, the feature picked (a select box a click moves) and the pinned nodes."""
    clicked = st.session_state.pop(_CLICKED, None)
    if isinstance(clicked, int) and clicked in feature_nodes:
        url_state.choose(NODE_KEY, labels[clicked])
    options = [labels[i] for i in feature_nodes]
    picked = linked(st.selectbox, "Feature (or click a feature in the graph)", options=options, index=0,
                    key=NODE_KEY) if options else None
    selected = feature_nodes[options.index(picked)] if picked in options else None
    pinned_labels = linked(st.multiselect, "Pinned nodes (a subgraph)", options=[labels[i] for i in kept], default=[],
                           key=PIN_KEY, help="Any node the pruning keeps.")
    pinned = tuple(labels.index(label) for label in pinned_labels)
    drawing = results.graph_drawing(loaded, loaded_tc, prompt.ids, settings, *thresholds, MAX_NODES, MAX_EDGES,
                                    selected, pinned, False)
    downloads.figure(drawing.figure, "attribution_graph", key=CHART_KEY,
                     on_select=click_keeper(CHART_KEY, _CLICKED, int))
    st.caption(f"Drawn: {len(drawing.nodes)} of the {drawing.n_kept_nodes} nodes the pruning keeps (logits, pinned, "
               f"then by influence; at most {MAX_NODES}) and {drawing.n_edges} of their {drawing.n_kept_edges} kept "
               f"edges (the largest; at most {MAX_EDGES}). Blue edges excite, red inhibit.")
    if pinned:
        st.subheader("Pinned subgraph")
        sub = results.graph_drawing(loaded, loaded_tc, prompt.ids, settings, *thresholds, MAX_NODES, MAX_EDGES,
                                    selected, pinned, True)
        downloads.figure(sub.figure, "attribution_subgraph", key="attribution_subgraph")
    return selected, list(pinned)


def _heads(loaded, loaded_tc, prompt: Prompt, settings: Settings, graph, labels: list[str], node: int) -> None:
    st.subheader("Its strongest incoming edges, and the heads that carry them")
    incoming = graph.adjacency_matrix[node]
    order = incoming.abs().argsort(descending=True)[:10]
    order = [int(i) for i in order if incoming[i] != 0]
    if not order:
        st.info("No edge reaches this feature.")
        return
    options = [f"{labels[i]} ({float(incoming[i]):+.4f})" for i in order]
    edge = linked(st.selectbox, "Incoming edge", options=options, index=0, key="attribution_edge")
    source = order[options.index(edge)] if edge in options else order[0]
    table, total, residual = results.heads_of_edge(loaded, loaded_tc, prompt.ids, settings, node, source)
    st.caption(f"The edge ({total:+.4f}) split over the last attention head on each path in the frozen model; "
               f"{residual:+.4f} of it goes through no head (the residual stream, same position only).")
    downloads.table(table.head(12), "edge_heads", key="attribution_heads_table")


def _intervention(loaded, loaded_tc, prompt: Prompt, graph, node: int, place: tuple[int, int, int]) -> None:
    st.subheader("Intervene on the feature")
    layer, position, feature = place
    activation = float(graph.activation_values[int(graph.selected_features[node])])
    cols = st.columns(3)
    with cols[0]:
        mode = linked(st.radio, "Edit", options=list(INTERVENTIONS), key="attribution_edit")
    with cols[1]:
        amount = linked(st.number_input, "Amount", min_value=-1000.0, max_value=1000.0, value=0.0, step=0.5,
                        key="attribution_amount")
    with cols[2]:
        frozen = linked(st.toggle, "Freeze attention", value=True, key="attribution_freeze")
    value = activation * float(amount) if INTERVENTIONS[mode] == "scale" else float(amount)
    st.caption(f"Feature {feature} of layer {layer} at position {position}: activation {activation:.4f} → {value:.4f}.")
    table = results.intervention_logits(loaded, loaded_tc, prompt.ids, layer, position, feature, value, bool(frozen),
                                        TOP_LOGITS)
    downloads.table(table, "intervention_logits", key="attribution_logits_table")


def main() -> None:
    st.title("Attribution graph")
    loaded = require_model()
    loaded_tc = _choose_transcoders(loaded)
    if loaded_tc is None:
        return
    prompt = prompt_box(loaded)
    if prompt is None:
        return
    settings, node_threshold, edge_threshold = _settings()
    if not _within_budget(loaded, loaded_tc, prompt, settings):
        return
    graph = results.attribution_graph(loaded, loaded_tc, prompt.ids, settings, bar=progress_callback)
    _, (replacement, completeness) = results.pruned_graph(loaded, loaded_tc, prompt.ids, settings, node_threshold,
                                                          edge_threshold)
    with st.container(key="attribution_graph_metrics", horizontal=True):
        st.metric("Active features", len(graph.active_features))
        st.metric("Nodes", graph.n_nodes)
        st.metric("Replacement score", f"{replacement:.4f}")
        st.metric("Completeness score", f"{completeness:.4f}")
    st.caption("Replacement score: the share of the logits' influence that comes from the prompt's tokens through "
               "features rather than through the transcoders' errors; completeness: the share of every node's input "
               "that is not error (circuit-tracer's scores; 1 for transcoders that reconstruct the MLPs exactly). "
               "A shipped set's card gives both on held-out prompts.")
    nodes = results.graph_nodes(loaded, loaded_tc, prompt.ids, settings, node_threshold, edge_threshold)
    node, _ = _graph_view(loaded, loaded_tc, prompt, settings, (node_threshold, edge_threshold), nodes.labels,
                          nodes.kept, nodes.kept_features)
    if node is None:
        st.info("The pruned graph keeps no feature: lower the node threshold.")
        return
    layer, _, feature = nodes.features[node]
    st.header(f"Feature {feature} of layer {layer}")
    loaded_sae = results.layer_sae(loaded_tc, layer)
    feature_card.on_prompt(loaded, loaded_sae, prompt, feature, PREFIX)
    _heads(loaded, loaded_tc, prompt, settings, graph, nodes.labels, node)
    _intervention(loaded, loaded_tc, prompt, graph, node, nodes.features[node])
    feature_card.logit_effect(loaded, loaded_sae, feature, PREFIX)
    feature_card.corpus(loaded, loaded_sae, feature, PREFIX)


page_setup("Attribution graph")
run_page(main)
