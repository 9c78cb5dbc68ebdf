"""Circuits over datasets: the edge graph, edge attribution patching (EAP, EAP-IG), exact edge patching.

Legend: B batch, P position, O circuit writers, I circuit readers, H n_heads, D d_model.

Modules: ``graph`` (``CircuitGraph``, ``circuit_graph``), ``runs`` (paired prompts, the patched pass),
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
from experiments.circuits.runs import PairedPrompts, paired_prompts

__all__ = ["Circuit", "Faithfulness", "acdc", "circuit_from_scores", "discover_circuit", "faithfulness",
           "faithfulness_curve", "CircuitGraph", "circuit_graph", "EdgeScores", "edge_attribution_patching", "edge_patching", "path_patching", "PairedPrompts",
           "paired_prompts"]
