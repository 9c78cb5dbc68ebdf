"""Circuits: the edges between the embedding, heads, MLPs and logits that carry a behaviour over prompt pairs (the IOI
or induction task as ``python -m experiments.circuits`` builds them, or one typed pair), scored by edge attribution
patching (EAP or EAP-IG) behind a button; how much of the gap the circuit recovers, first and in a sentence (the
defaults, a typed IOI pair with EAP-IG's 200 strongest edges, recover 0.75 of it on SmolLM2-135M); the circuit drawn
with layers as rows and a bounded number of nodes and edges, the faithfulness curve, the strongest edges as a table,
and a clicked edge's exact patching effect with the attention patterns of the heads at its two ends.
"""

from __future__ import annotations

from typing import Optional

import streamlit as st
import torch

from app import downloads, results, url_state
from app.results import CircuitTask
from app.results.circuits import DEFAULT_ABLATION, DEFAULT_IG_STEPS, DEFAULT_METHOD, DEFAULT_TASK, DEFAULT_TOP_N
from app.state import LoadedModel
from app.url_state import linked
from app.widgets import click_keeper, page_setup, progress_callback, prompt_pair, require_model, run_page
from experiments.plots.attention import pattern_figure
from experiments.plots.circuits import faithfulness_curve_figure

TASKS = {"induction": "Induction task (repeated random tokens)", "ioi": "IOI task (generated prompt pairs)",
         "pair": "A prompt pair (logit difference)"}
METHODS = {"eap-ig": "EAP-IG (integrated gradients)", "eap": "EAP (one gradient)"}
SIZES = {"top_n": "The strongest edges", "threshold": "Edges above a |score|"}
ABLATIONS = {"corrupt": "the corrupted run's values", "mean": "their mean over the corrupted prompts", "zero": "zero"}
EDGE_KEY, CHART_KEY = "circuits_edge", "circuits_graph"
MAX_NODES, MAX_EDGES = 150, 400   # what the drawing sends the browser, whatever the circuit's size
TABLE_ROWS = 500                  # the edge table shown (the download holds the same rows)
_CLICKED = "_circuits_clicked"    # the edge clicked last, applied to the select box on the next run


def _pair_task(loaded: LoadedModel) -> Optional[CircuitTask]:
    pair = prompt_pair(loaded.model, "circuits")
    if pair is None:
        return None
    return CircuitTask("pair", n=1, clean=pair.clean, corrupt=pair.corrupt, answer=pair.answer, wrong=pair.wrong)


def _task(loaded: LoadedModel) -> Optional[CircuitTask]:
    """The prompt pairs chosen, checked; None after saying what is wrong."""
    kind = linked(st.radio, "Prompts", options=list(TASKS), format_func=TASKS.get, horizontal=True,
                  index=list(TASKS).index(DEFAULT_TASK), key="circuits_task")
    if kind != "induction" and loaded.model.tokenizer is None:
        st.info("This model has no tokenizer: the IOI task and typed prompts are text. Use the induction task.")
        return None
    if kind == "pair":
        return _pair_task(loaded)
    cols = st.columns(3)
    with cols[0]:
        n = linked(st.number_input, "Prompt pairs", min_value=1, max_value=64, value=8, step=1, key="circuits_n")
    with cols[1]:
        seed = linked(st.number_input, "Seed", min_value=0, max_value=1_000_000, value=0, step=1, key="circuits_seed")
    with cols[2]:
        if kind == "induction":
            seq_len = linked(st.number_input, "Repeated tokens", min_value=2, max_value=128, value=10, step=1,
                             key="circuits_seq_len",
                             help="Each prompt: a start token, then this many random tokens twice.")
            if 2 * seq_len + 1 > loaded.model.cfg.n_ctx:
                st.error(f"{2 * int(seq_len) + 1} tokens do not fit the model's context of {loaded.model.cfg.n_ctx}: "
                         "repeat fewer tokens.")
                return None
            return CircuitTask("induction", n=int(n), seed=int(seed), seq_len=int(seq_len))
        names = linked(st.text_input, "Names (optional)", value="", key="circuits_names",
                       help="Space-separated names, each one token after a space; empty: the default names.")
    return CircuitTask("ioi", n=int(n), seed=int(seed), names=tuple(names.split()[:100]))


def _settings() -> tuple[str, int, Optional[int], Optional[float], str]:
    cols = st.columns(4)
    with cols[0]:
        method = linked(st.radio, "Method", options=list(METHODS), format_func=METHODS.get,
                        index=list(METHODS).index(DEFAULT_METHOD), key="circuits_method")
    with cols[1]:
        ig_steps = linked(st.number_input, "Integration steps", min_value=1, max_value=50, value=DEFAULT_IG_STEPS,
                          step=1, key="circuits_ig_steps", disabled=method == "eap",
                          help="EAP-IG's points on the corrupt -> clean path (one step is EAP).")
    with cols[2]:
        size = linked(st.radio, "Circuit", options=list(SIZES), format_func=SIZES.get, key="circuits_size")
        if size == "top_n":
            top_n = linked(st.number_input, "Edges kept", min_value=1, max_value=1_000_000, value=DEFAULT_TOP_N,
                           step=10, key="circuits_top_n")
            threshold = None
        else:
            threshold = linked(st.number_input, "Smallest |score| kept", min_value=0.0, max_value=1e6, value=0.01,
                               step=0.01, format="%.4g", key="circuits_threshold")
            top_n = None
    with cols[3]:
        ablation = linked(st.selectbox, "Edges outside the circuit carry", options=list(ABLATIONS),
                          format_func=ABLATIONS.get,
                          index=list(ABLATIONS).index(DEFAULT_ABLATION), key="circuits_ablation")
    return method, 1 if method == "eap" else int(ig_steps), None if top_n is None else int(top_n), \
        None if threshold is None else float(threshold), ablation


def _graph(loaded: LoadedModel, task: CircuitTask, run: tuple, edges: list[str]) -> Optional[str]:
    """The drawing above the slider's cutoff and the edge picked (a select box a click moves)."""
    clicked = st.session_state.pop(_CLICKED, None)
    if clicked in edges:
        url_state.choose(EDGE_KEY, clicked)
    min_share = linked(st.slider, "Draw edges with |score| at least this share of the largest", min_value=0.0,
                       max_value=1.0, value=0.0, step=0.01, key="circuits_min_score")
    edge = linked(st.selectbox, "Edge (or click an edge's diamond in the graph)", options=edges, index=0,
                  key=EDGE_KEY) if edges else None
    drawing = results.circuit_drawing(loaded, task, *run, float(min_share), MAX_NODES, MAX_EDGES, edge)
    downloads.figure(drawing.figure, "circuit_graph", key=CHART_KEY, on_select=click_keeper(CHART_KEY, _CLICKED, str))
    st.caption(f"Drawn: {len(drawing.edges)} of the {drawing.n_above} circuit edges with |score| ≥ "
               f"{drawing.cutoff:.4g} (the largest first; at most {MAX_EDGES} edges and {MAX_NODES} nodes), joining "
               f"{len(drawing.nodes)} nodes. Red: patching the edge toward clean raises the metric; blue: lowers it. "
               "Edges into a head arrive at its query (left), key (middle) or value (right) input.")
    return edge


def _patterns(loaded: LoadedModel, task: CircuitTask, edge: str) -> None:
    writer, reader = edge.split("->")
    heads = [name.split("<")[0] for name in (writer, reader) if name.startswith("a")]
    if not heads:
        st.caption("Neither end of this edge is a head: no attention pattern to show.")
        return
    ids = results.first_clean_ids(loaded, task)
    patterns_LHPS = results.attention_patterns(loaded, ids)
    model = loaded.model
    labels = model.to_str_tokens(torch.tensor(ids)) if model.tokenizer is not None else [str(i) for i in ids]
    for i, (column, head) in enumerate(zip(st.columns(len(heads)), heads)):
        layer, index = int(head[1:].split(".")[0]), int(head.split(".h")[1])
        with column:
            fig = pattern_figure(patterns_LHPS[layer, index], labels, f"L{layer}H{index} on the first clean prompt")
            downloads.figure(fig, f"circuits_pattern_L{layer}H{index}", key=f"circuits_pattern_{i}",
                             stretch=False)


def _edge_card(loaded: LoadedModel, task: CircuitTask, edge: str, score: float) -> None:
    st.header(f"Edge {edge}")
    effect = results.edge_effect(loaded, task, edge)
    with st.container(key="circuits_edge_metrics", horizontal=True):
        st.metric("Attribution score", f"{score:.4f}", help="The edge's score summed over positions")
        st.metric("Exact patching effect", f"{effect['delta']:.4f}",
                  help="The metric's change when this edge carries the clean run's value at every position "
                       "(edge_patching), mean over the pairs")
        st.metric("Share of the gap", f"{effect['normalized']:.4f}", help="The effect / (clean - corrupt)")
    _patterns(loaded, task, edge)


def _how_faithful(kept, ablation: str) -> None:
    """One sentence next to the graph: how much of the behaviour the circuit alone carries, and what that means."""
    if kept.recovered != kept.recovered:   # NaN: no gap to recover
        st.warning("The clean and corrupted runs give the same metric: there is no gap for a circuit to recover.")
        return
    verdict = ("faithful" if kept.recovered >= 0.8 else "partly faithful" if kept.recovered >= 0.5
               else "not faithful: keep more edges (the curve below shows how many)")
    text = (f"**The circuit recovers {100 * kept.recovered:.0f}% of the gap: {verdict}.** With only its "
            f"{kept.n_edges} of the graph's {kept.total_edges:,} edges carrying the clean run (every other edge "
            f"carrying {ABLATIONS[ablation]}), the metric is {kept.circuit_metric:.3f}, where the clean run gives "
            f"{kept.clean_metric:.3f} and the corrupted one {kept.corrupt_metric:.3f}. "
            "Recovered = (circuit − corrupt) / (clean − corrupt): 100% is the whole model's behaviour, 0% none of it.")
    (st.success if kept.recovered >= 0.8 else st.info if kept.recovered >= 0.5 else st.warning)(text)


def main() -> None:
    st.title("Circuits")
    loaded = require_model()
    task = _task(loaded)
    if task is None:
        return
    method, ig_steps, top_n, threshold, ablation = _settings()
    run = (method, ig_steps, top_n, threshold)
    pressed = st.button("Find the circuit", key="circuits_run", type="primary",
                        help="Scores every edge over the pairs (one forward and backward pass per batch and step), "
                             "measures the circuit's faithfulness (one ablated pass), then the faithfulness curve "
                             "(12 circuit sizes in stacked passes).")
    stored = (results.has_edge_scores(loaded, task, method, ig_steps)
              and results.has_faithfulness_curve(loaded, task, method, ig_steps, ablation))
    if not (pressed or stored):   # a new task, method or ablation: its long runs wait for a click
        st.info("Press “Find the circuit” to score the edges of these prompt pairs and measure the faithfulness "
                "curve.")
        return
    scores = results.edge_scores(loaded, task, method, ig_steps, bar=progress_callback)
    found = results.circuit(loaded, task, *run)
    kept = None   # one ablated pass per pair batch: measured on a click, as the scores are
    if pressed or results.has_circuit_faithfulness(loaded, task, *run, ablation):
        kept = results.circuit_faithfulness(loaded, task, *run, ablation, bar=progress_callback)
    with st.container(key="circuits_metrics", horizontal=True):
        st.metric("Gap recovered", "press the button" if kept is None else f"{kept.recovered:.4f}",
                  help=f"(circuit - corrupt) / (clean - corrupt), every other edge carrying {ABLATIONS[ablation]}; "
                       "a new circuit size is measured when you press “Find the circuit”")
        st.metric("Clean metric", f"{scores.attrs['clean_metric']:.4f}", help="Mean over the pairs")
        st.metric("Corrupted metric", f"{scores.attrs['corrupt_metric']:.4f}")
        st.metric("Circuit edges", found.n_edges, help=f"of the graph's {found.graph.n_edges}")
        st.metric("Share of the edges", f"{100 * found.share:.2f}%")
    if kept is not None:
        _how_faithful(kept, ablation)
    table = results.circuit_table(loaded, task, *run, TABLE_ROWS)
    edge = _graph(loaded, task, run, table["edge"].tolist()[:MAX_EDGES])
    left, right = st.columns(2)
    with left:
        st.subheader("Faithfulness curve")
        curve = results.faithfulness_curve(loaded, task, method, ig_steps, ablation, bar=progress_callback)
        downloads.figure(faithfulness_curve_figure(curve), "circuit_faithfulness", key="circuits_curve")
    with right:
        st.subheader("The circuit's edges")
        downloads.table(table, "circuit_edges", key="circuits_edges_table", height=360)
    if edge is None:
        st.info("The circuit has no edge: keep more edges or lower the threshold.")
        return
    _edge_card(loaded, task, edge, float(table.loc[table["edge"] == edge, "score"].iloc[0]))


page_setup("Circuits")
run_page(main)
