"""The Attribution graph page under Streamlit's AppTest, on the committed circuit-tracer fixtures (a tiny random
Llama and its per-layer transcoders, ``tests/fixtures/attribution``): the page's graph numbers are circuit-tracer
0.5's own (its active features and scores on the same prompt and settings), the drawing is bounded, a linked feature
opens its card, pinned nodes draw a subgraph, an intervention's logits are ``intervene``'s (itself checked against
circuit-tracer), and bad paths are messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from streamlit.testing.v1 import AppTest

import workbench as wb
from experiments.attribution import AttributionGraph, attribute, intervene, prune_graph
from experiments.plots.attribution import graph_figure, node_labels
from tests.unit.test_app_pages import APP, dense  # noqa: F401

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "attribution"
MODEL, PLT = str(FIXTURES / "tiny_llama"), str(FIXTURES / "plt")
PROMPT = "the cat sat on the mat and"       # <bos> the cat sat on the mat and: the fixtures' prompt
A_PATH = "A path on this machine"
PAGE = str(APP / "pages" / "13_Attribution.py")
SETTINGS = {"attribution_max_logits": "5", "attribution_logit_prob": "0.8", "attribution_corpus": "false"}


def open_page(source: str = MODEL, path: str = PLT, click: bool = True, **params: str) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.session_state["model_source"] = source
    at.session_state["prompt"] = PROMPT
    for key, value in {"attribution_tc_source": A_PATH, "attribution_tc_path": path, **SETTINGS, **params}.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    if click:  # a path from a link is read only after a click
        assert not at.get("plotly_chart") and any("read only when you open them" in i.value for i in at.info)
        at.button(key="attribution_open_tc").click().run()
        assert not at.exception, [e.value for e in at.exception]
    return at


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def test_the_page_shows_circuit_tracers_graph_and_a_feature_card():
    expected = load_file(str(FIXTURES / "expected_plt.safetensors"))
    scores = json.loads((FIXTURES / "expected_plt.json").read_text())
    at = open_page()
    assert metric(at, "Active features") == str(expected["active_features"].shape[0])
    assert metric(at, "Replacement score") == f"{scores['replacement_score']:.4f}"
    assert metric(at, "Completeness score") == f"{scores['completeness_score']:.4f}"
    assert at.get("plotly_chart") and any(c.value.startswith("Drawn: ") for c in at.caption)
    feature_box = at.selectbox(key="attribution_node")
    layer, feature = int(feature_box.value.split()[0][1:]), int(feature_box.value.split()[1][1:])
    assert any(h.value == f"Feature {feature} of layer {layer}" for h in at.header)
    assert metric(at, "Tokens where it fires")          # the Features page's card, on this layer's transcoder
    assert at.query_params["attribution_node"] == feature_box.value


def test_a_linked_feature_pinned_nodes_and_an_intervention():
    model = wb.load_model(MODEL)
    tc = wb.load_transcoders(PLT)
    graph = attribute(model, tc, PROMPT, max_n_logits=5, desired_logit_prob=0.8, progress=False)
    labels = node_labels(graph)
    kept = prune_graph(graph).node_mask.nonzero().flatten().tolist()
    node = [i for i in kept if i < len(graph.selected_features)][-1]
    pinned = [labels[node], labels[-1]]
    at = open_page(attribution_node=labels[node], attribution_pinned=json.dumps(pinned),
                   attribution_edit="Set the activation to", attribution_amount="0.0")
    layer, position, feature = graph.active_features[int(graph.selected_features[node])].tolist()
    assert any(h.value == f"Feature {feature} of layer {layer}" for h in at.header)
    assert any(s.value == "Pinned subgraph" for s in at.subheader) and len(at.get("plotly_chart")) >= 2
    table = next(d.value for d in at.dataframe if "clean_logit" in d.value)
    logits = intervene(model, tc, graph.input_tokens, [(layer, position, feature, 0.0)]).logits[-1]
    torch.testing.assert_close(torch.tensor(table["logit"].tolist()), logits[table["token_id"].tolist()].float(),
                               atol=1e-5, rtol=0)
    heads = next(d.value for d in at.dataframe if "head" in d.value and "contribution" in d.value)
    assert len(heads) > 0 or any("no head" in c.value for c in at.caption)


def test_a_missing_or_unfitting_path_is_a_message(dense, tmp_path):  # noqa: F811
    at = open_page(path=str(tmp_path / "missing"))
    assert any(e.value.startswith("Could not load the transcoders at `") for e in at.error)
    at = open_page(source=dense)   # the fixture's transcoders on a model of another width
    assert any("do not fit the open model" in e.value for e in at.error) and not at.get("plotly_chart")
    at = open_page(path="", click=False)
    assert any("Enter the path of transcoders" in i.value for i in at.info)


def test_the_drawing_is_bounded_whatever_the_graph():
    n_features, n_pos, n_layers = 300, 4, 2
    n = n_features + (n_layers + 1) * n_pos + 1
    generator = torch.Generator().manual_seed(0)
    adjacency = torch.zeros(n, n)
    adjacency[:, :n - 1] = torch.randn(n, n - 1, generator=generator)
    adjacency[:n_features, :n_features] = adjacency[:n_features, :n_features].tril(-1)   # acyclic
    adjacency[n_features:n - 1] = 0
    active = torch.stack([torch.arange(n_features) % n_layers, 1 + torch.arange(n_features) % (n_pos - 1),
                          torch.arange(n_features)], 1)
    order = sorted(range(n_features), key=lambda i: active[i].tolist())
    graph = AttributionGraph("a b c", torch.arange(n_pos), active[order], torch.ones(n_features),
                             torch.arange(n_features), adjacency, torch.tensor([1]), torch.ones(1), n_layers, 10)
    pruned = prune_graph(graph, node_threshold=1.0, edge_threshold=1.0)
    drawing = graph_figure(graph, pruned, max_nodes=40, max_edges=60)
    drawn_nodes = sum(len(trace.x) for trace in drawing.figure.data if trace.mode == "markers")
    drawn_edges = sum(len(trace.x) // 3 for trace in drawing.figure.data if trace.mode == "lines")
    assert drawing.n_kept_nodes > 40 and drawn_nodes == len(drawing.nodes) == 40
    assert drawing.n_kept_edges > 60 and drawn_edges == drawing.n_edges == 60
    assert n - 1 in drawing.nodes    # the logit is always drawn
