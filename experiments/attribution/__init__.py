"""Attribution graphs (circuit tracing) of one prompt through transcoders, circuit-tracer 0.5's semantics.

- ``attribute``: ``attribute(model, transcoders, prompt, ...)`` -> ``AttributionGraph``;
- ``replacement``: ``ReplacementModel``, the model with transcoders for MLPs (circuit-tracer's name), the one place
  patterns and norm divisors are frozen: ``attribute``, ``intervene`` and the attention explanations all use it;
  ``mlp_transcoders``, a model's own ReLU MLPs as an exact transcoder set;
- ``linearised``: the frozen, linearised forward pass whose gradients are the edges;
- ``targets``: the logit nodes; ``influence``: influence, ``prune_graph``, ``compute_graph_scores``;
- ``graph``: ``AttributionGraph`` (circuit-tracer's field names; saved as safetensors + JSON);
- ``intervention``: ``intervene``, circuit-tracer's feature interventions (set features, read the logits);
- ``plan``: ``plan_attribution``, the bytes ``attribute`` will hold, before running it;
- ``attention``: ``edge_heads`` (an edge split per attention head) and ``attention_qk`` (a head's score split
  over the query's and the key's residual parts), what circuit-tracer leaves out;
- ``export``: the pruned graph as circuit-tracer's and Neuronpedia's viewer JSON (``graph_json``, ``write_graph_files``).

Transcoders are ``wb.load_transcoders`` / ``wb.TranscoderSet`` (``workbench.transcoders``).
"""

from experiments.attribution.attention import EdgeHeads, QKAttribution, attention_qk, edge_heads
from experiments.attribution.attribute import attribute, prompt_tokens
from experiments.attribution.export import graph_json, write_graph_files
from experiments.attribution.graph import AttributionGraph
from experiments.attribution.intervention import InterventionResult, intervene
from experiments.attribution.plan import forward_copies, plan_attribution
from experiments.attribution.replacement import ReplacementModel, mlp_transcoders
from experiments.attribution.influence import (PruneResult, compute_graph_scores, compute_influence, graph_scores,
                                               normalize_matrix, prune_graph)

__all__ = ["attribute", "prompt_tokens", "AttributionGraph", "PruneResult", "prune_graph", "compute_graph_scores",
           "graph_scores", "compute_influence", "normalize_matrix", "graph_json", "write_graph_files", "intervene", "InterventionResult",
           "plan_attribution", "forward_copies", "edge_heads", "EdgeHeads", "attention_qk", "QKAttribution",
           "ReplacementModel", "mlp_transcoders"]
