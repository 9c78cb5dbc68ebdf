"""The Circuits page under Streamlit's AppTest on the toy attention model (toy-attn-2l, as the other page tests): the
page draws nothing heavy before its button; a run draws the circuit ``experiments.circuits.discover_circuit`` finds
for the same pairs and settings, the slider leaves the edges a hand count says, the faithfulness curve ends at the
whole gap and the circuit's metric is ``faithfulness``'s; a picked edge (select box, link or click) shows
``edge_patching``'s effect for it and its heads' patterns; bad input is a message."""

from __future__ import annotations

import base64
import json

import numpy as np

import pytest
import torch
from streamlit.testing.v1 import AppTest

import workbench as wb
from experiments.circuits import discover_circuit, edge_attribution_patching, edge_patching, faithfulness
from experiments.circuits.tasks import induction_pairs
from tests.unit.test_app_pages import APP, assert_clean, chart, dense  # noqa: F401

PAGE = str(APP / "pages" / "14_Circuits.py")
N, SEQ_LEN, TOP_N = 4, 6, 20
SETTINGS = {"circuits_task": "induction", "circuits_n": str(N), "circuits_seq_len": str(SEQ_LEN),
            "circuits_method": "eap", "circuits_top_n": str(TOP_N)}


def open_page(source: str, run: bool = True, **params: str) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.session_state["model_source"] = source
    for key, value in {**SETTINGS, **params}.items():
        at.query_params[key] = value
    at.run()
    assert_clean(at)
    if run:
        at.button(key="circuits_run").click().run()
        assert_clean(at)
    return at


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def values(spec) -> list[float]:
    """A figure's array as a list: plotly sends numeric arrays as base64 typed arrays."""
    if isinstance(spec, dict):
        return np.frombuffer(base64.b64decode(spec["bdata"]), dtype=spec["dtype"]).tolist()
    return list(spec)


def drawn_edges(at: AppTest) -> list[str]:
    """The edges the graph draws: the customdata of its edge markers."""
    trace = next(t for t in chart(at, "circuits_graph")["data"] if t.get("name") == "edges")
    return list(trace["customdata"])


@pytest.fixture(scope="module")
def toy(dense):  # noqa: F811
    model = wb.load_model(dense, progress=False).eval()
    pairs = induction_pairs(model, SEQ_LEN, N, 0)
    return model, pairs, discover_circuit(model, pairs, method="eap", top_n=TOP_N)


def waiting(at: AppTest) -> bool:
    """The page asks for the button and draws no chart."""
    return any("Find the circuit" in i.value for i in at.info) and not at.get("plotly_chart")


def test_nothing_heavy_runs_before_the_button(dense, toy):  # noqa: F811
    at = open_page(dense, run=False, circuits_seed="1")
    assert waiting(at)
    at.button(key="circuits_run").click().run()
    assert_clean(at)
    assert not waiting(at) and metric(at, "Circuit edges") == str(TOP_N)
    at.selectbox(key="circuits_ablation").set_value("mean").run()    # another curve: a long run, so a click again
    assert waiting(at)
    at.button(key="circuits_run").click().run()
    assert not waiting(at) and chart(at, "circuits_curve")
    at.slider(key="circuits_min_score").set_value(0.3).run()        # the rest is cheap and cached: no click
    assert not waiting(at)
    at.number_input(key="circuits_top_n").set_value(10).run()        # a new circuit: drawn, its faithfulness waits
    assert metric(at, "Circuit edges") == "10" and metric(at, "Gap recovered") == "press the button"
    at.button(key="circuits_run").click().run()
    pairs = induction_pairs(toy[0], SEQ_LEN, N, 1)
    ten = discover_circuit(toy[0], pairs, method="eap", top_n=10)
    assert metric(at, "Gap recovered") == f"{faithfulness(toy[0], pairs, None, ten, 'mean').recovered:.4f}"


def test_a_run_draws_the_discovered_circuit_and_its_faithfulness(dense, toy):  # noqa: F811
    model, pairs, expected = toy
    at = open_page(dense)
    assert sorted(drawn_edges(at)) == sorted(expected.edges)                    # all 20 fit under the caps
    assert metric(at, "Circuit edges") == str(TOP_N)
    table = next(d.value for d in at.dataframe if "edge" in d.value)
    frame = expected.to_frame()
    assert table["edge"].tolist() == frame["edge"].tolist()
    torch.testing.assert_close(torch.tensor(table["score"].tolist()), torch.tensor(frame["score"].tolist()))
    kept = faithfulness(model, pairs, None, expected)
    assert metric(at, "Gap recovered") == f"{kept.recovered:.4f}"
    curve = chart(at, "circuits_curve")["data"][0]
    # the curve's last point keeps every edge: the whole clean - corrupt gap
    assert values(curve["x"])[-1] == 1.0 and abs(values(curve["y"])[-1] - 1.0) < 1e-4
    # the slider keeps the edges with |score| >= half the largest: counted by hand from the circuit's scores
    magnitude = frame["score"].abs()
    at.slider(key="circuits_min_score").set_value(0.5).run()
    assert_clean(at)
    assert sorted(drawn_edges(at)) == sorted(frame.loc[magnitude >= 0.5 * magnitude.max(), "edge"])
    assert at.query_params["circuits_min_score"] == "0.5"
    # a circuit by threshold: every edge whose summed |score| reaches it (counted from the scores by hand)
    at.slider(key="circuits_min_score").set_value(0.0)
    at.radio(key="circuits_size").set_value("threshold").run()
    at.number_input(key="circuits_threshold").set_value(0.1).run()
    assert_clean(at)
    summed = edge_attribution_patching(model, pairs, method="eap").summed()
    assert metric(at, "Circuit edges") == str(int((summed.abs() >= 0.1).sum()))
    assert sorted(drawn_edges(at)) == sorted(discover_circuit(model, pairs, method="eap", threshold=0.1).edges)


def test_a_picked_edge_shows_its_exact_patching_effect_and_patterns(dense, toy):  # noqa: F811
    model, pairs, expected = toy
    edge = next(e for e in expected.edges if e.startswith("a0.") and "->a1." in e)    # a head -> head edge
    (l0, h0), (l1, h1) = [(int(n[1]), int(n.split(".h")[1][0])) for n in edge.split("->")]
    at = open_page(dense, circuits_edge=edge)   # linked
    delta = float(edge_patching(model, pairs, edges=[edge])["delta"].iloc[0])
    assert any(h.value == f"Edge {edge}" for h in at.header)
    assert metric(at, "Exact patching effect") == f"{delta:.4f}"
    titles = [chart(at, f"circuits_pattern_{i}")["layout"]["title"]["text"] for i in range(2)]
    assert titles == [f"L{l0}H{h0} on the first clean prompt", f"L{l1}H{h1} on the first clean prompt"]
    # a click on another edge's marker (what the chart's selection callback records) moves the select box
    other = next(e for e in drawn_edges(at) if e != edge and e.endswith("->logits"))
    at.session_state["_circuits_clicked"] = other
    at.run()
    assert_clean(at)
    assert at.selectbox(key="circuits_edge").value == other and at.query_params["circuits_edge"] == other
    delta = float(edge_patching(model, pairs, edges=[other])["delta"].iloc[0])
    assert metric(at, "Exact patching effect") == f"{delta:.4f}"
    marker = next(t for t in chart(at, "circuits_graph")["data"] if t.get("name") == "edges")
    assert values(marker["marker"]["size"])[list(marker["customdata"]).index(other)] == 13   # drawn as selected


def test_bad_input_is_a_message(dense):  # noqa: F811
    # a task the page does not know falls back to the default (a typed pair, which has no pair count), so the bad
    # pair count is linked with a task that draws its box: each bad value is a message
    at = open_page(dense, run=False, circuits_edge="<b>no</b>", circuits_task="nope")
    bad_task = sum("does not fit here" in w.value for w in at.warning)
    at = open_page(dense, run=False, circuits_n="1000", circuits_edge="<b>no</b>", circuits_task="induction")
    bad_n = sum("does not fit here" in w.value for w in at.warning)
    assert bad_task >= 1 and bad_n >= 1 and bad_task + bad_n >= 2
    at = open_page(dense, run=False, circuits_task="ioi")    # the toy's tokenizer splits the default names
    assert at.button(key="circuits_run")
    at.button(key="circuits_run").click().run()
    assert_clean(at)
    assert any("single-token names" in e.value for e in at.error) and not at.get("plotly_chart")
    at = open_page(dense, run=False, circuits_task="pair", circuits_answer=" Mary")
    assert any("is not one token of this model's vocabulary" in e.value for e in at.error)
    at = open_page(dense, run=False, circuits_seq_len="128")
    assert any("do not fit the model's context" in e.value for e in at.error)
    assert json.dumps(dict(at.query_params))      # the link still holds every choice
