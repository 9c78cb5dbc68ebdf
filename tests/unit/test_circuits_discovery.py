"""Circuits on the zoo's toy-attn-2l (previous-token head L0H0, induction heads in layer 1: its model
card), faithfulness by construction, ACDC.

The induction task's corrupted prompts repeat a different first copy, so only the clean run can predict the
second copy; the circuit must hold the K-composition edge from the previous-token head into an induction head's
key. The whole graph kept recovers the clean run exactly and none kept gives the corrupted run (corrupt
ablation): both by construction, no tolerance on the model's numbers beyond float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from experiments.circuits import Circuit, acdc, discover_circuit, edge_attribution_patching, faithfulness, faithfulness_curve
from experiments.circuits.tasks import induction_pairs

INDUCTION_KEYS = {f"a0.h0->a1.h{h}<k>" for h in range(4)}


@pytest.fixture(scope="module")
def model():
    return wb.load_model("toy-attn-2l").eval()


@pytest.fixture(scope="module")
def pairs(model):
    return induction_pairs(model, seq_len=8, n=4)


def test_the_discovered_circuit_holds_the_previous_token_to_induction_head_edge(model, pairs):
    circuit = discover_circuit(model, pairs, method="eap-ig", top_n=20, ig_steps=2)
    assert INDUCTION_KEYS & set(circuit.edges)
    assert (0, 0) in circuit.heads and circuit.share < 0.25
    assert faithfulness(model, pairs, None, circuit).recovered > 0.5


def test_faithfulness_of_all_and_no_edges_and_the_curve(model, pairs):
    scores = edge_attribution_patching(model, pairs)
    graph = scores.graph
    whole = faithfulness(model, pairs, None, Circuit(graph, graph.edge_mask))
    assert abs(whole.recovered - 1) < 1e-4
    empty = faithfulness(model, pairs, None, Circuit(graph, torch.zeros_like(graph.edge_mask)))
    assert abs(empty.recovered) < 1e-4
    zero = faithfulness(model, pairs, None, Circuit(graph, torch.zeros_like(graph.edge_mask)), ablation="zero")
    assert abs(zero.recovered) > 1e-3  # zeros are not the corrupted run
    curve = faithfulness_curve(model, pairs, None, scores, [0, 10, graph.n_edges], ablation="mean")
    assert curve["n_edges"].tolist() == [0, 10, graph.n_edges] and abs(curve["recovered"].iloc[-1] - 1) < 1e-4


def test_acdc_prunes_and_keeps_the_induction_edge(model):
    circuit = acdc(model, induction_pairs(model, seq_len=6, n=2), None, threshold=0.3)
    assert circuit.n_edges < circuit.graph.n_edges / 2
    assert INDUCTION_KEYS & set(circuit.edges)
