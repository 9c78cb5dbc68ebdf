"""Circuits over datasets: the edge graph, edge attribution patching (EAP, EAP-IG), exact edge patching.

Legend: B batch, P position, O circuit writers, I circuit readers, H n_heads, D d_model.

Every entry point takes a ``PairedPrompts`` (``experiments.patching.pairs``, the one prompt-pair type of patching and
circuits) as its first data argument; the older forms (clean, corrupt and metric, or a dataset and a metric, as
separate arguments) are still taken.

Modules: ``graph`` (``CircuitGraph``, ``circuit_graph``), ``runs`` (the edge switches, the patched pass),
``eap`` (``edge_attribution_patching``, ``EdgeScores``), ``exact`` (``edge_patching``), ``circuit``
(``Circuit``, ``discover_circuit``, ``acdc``, ``faithfulness``, ``faithfulness_curve``), ``tasks`` (``induction_pairs``), ``paths``
(``path_patching``).
"""

from experiments.circuits.circuit import (Circuit, Faithfulness, acdc, circuit_from_scores, discover_circuit,
                                          faithfulness, faithfulness_curve)
from experiments.circuits.eap import EdgeScores, edge_attribution_patching
from experiments.circuits.exact import edge_patching
from experiments.circuits.paths import path_patching
from experiments.circuits.graph import CircuitGraph, circuit_graph
from experiments.circuits.runs import paired_prompts
from experiments.patching.pairs import PairedPrompts

__all__ = ["Circuit", "Faithfulness", "acdc", "circuit_from_scores", "discover_circuit", "faithfulness",
           "faithfulness_curve", "CircuitGraph", "circuit_graph", "EdgeScores", "edge_attribution_patching", "edge_patching", "path_patching", "PairedPrompts",
           "paired_prompts"]
