"""Influence, pruning and graph scores, circuit-tracer 0.5's definitions (its ``graph.py``).

The adjacency is normalised row by row (absolute values, each target's inputs summing to one); a node's influence
on the logits is the logit-probability-weighted sum over every path, ``w A + w A^2 + ...``, computed by repeated
products until they vanish (the graph is acyclic). Pruning keeps the nodes carrying ``node_threshold`` of the
total influence, then the edges carrying ``edge_threshold`` of the total edge influence, then drops nodes left
without outgoing or (features) incoming edges until nothing changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from workbench.errors import InputError

if TYPE_CHECKING:
    from experiments.attribution.graph import AttributionGraph


def normalize_matrix(matrix: Float[Tensor, "row col"]) -> Float[Tensor, "row col"]:
    """``|matrix|`` with each row summing to one (rows of zeros stay zero).

    Example:
        >>> normalize_matrix(torch.tensor([[1.0, -3.0], [0.0, 0.0]]))
        tensor([[0.2500, 0.7500],
                [0.0000, 0.0000]])
    """
    normalized = matrix.abs()
    return normalized / normalized.sum(dim=1, keepdim=True).clamp(min=1e-10)


def compute_influence(A: Float[Tensor, "node node"], logit_weights: Float[Tensor, "node"], max_iter: int = 1000,
                      ) -> Float[Tensor, "node"]:
    """``w A + w A^2 + ...`` until the products vanish; an ``InputError`` if they never do (a cyclic matrix).

    Example:
        >>> A = torch.tensor([[0.0, 0.0], [1.0, 0.0]])          # node 1 reads node 0
        >>> compute_influence(A, torch.tensor([0.0, 1.0]))
        tensor([1., 0.])
    """
    current = logit_weights @ A
    influence = current
    for _ in range(max_iter):
        if not current.any():
            return influence
        current = current @ A
        influence = influence + current
    raise InputError(f"influence did not converge in {max_iter} iterations: the adjacency is not acyclic")


def compute_partial_influences(edge_matrix: Float[Tensor, "rows node"], logit_p: Float[Tensor, "logit"],
                               row_to_node_index: Int[Tensor, "rows"], max_iter: int = 128) -> Float[Tensor, "node"]:
    """Influence of every node through the rows computed so far (circuit-tracer orders features by it).

    Example:
        >>> compute_partial_influences(torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([1.0]), torch.tensor([2]))
        tensor([1., 0., 0.])
    """
    normalized = normalize_matrix(edge_matrix)
    influences = torch.zeros(edge_matrix.shape[1])
    prod = torch.zeros(edge_matrix.shape[1])
    prod[-len(logit_p):] = logit_p
    for _ in range(max_iter):
        prod = prod[row_to_node_index] @ normalized
        if not prod.any():
            return influences
        influences += prod
    raise InputError(f"partial influences did not converge in {max_iter} iterations")


def _find_threshold(scores: Float[Tensor, "node"], threshold: float) -> Tensor:
    sorted_scores = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(sorted_scores, dim=0) / torch.sum(sorted_scores)
    index = min(int(torch.searchsorted(cumulative, threshold).item()), len(cumulative) - 1)
    return sorted_scores[index]


def _logit_weights(graph: "AttributionGraph") -> Float[Tensor, "node"]:
    weights = torch.zeros(graph.adjacency_matrix.shape[0])
    weights[-len(graph.logit_token_ids):] = graph.logit_probabilities
    return weights


class PruneResult(NamedTuple):
    """Which nodes and edges ``prune_graph`` keeps, and each node's cumulative influence score."""

    node_mask: Bool[Tensor, "node"]
    edge_mask: Bool[Tensor, "node node"]
    cumulative_scores: Float[Tensor, "node"]


def prune_graph(graph: "AttributionGraph", node_threshold: float = 0.8, edge_threshold: float = 0.98) -> PruneResult:
    """Nodes and edges carrying ``node_threshold`` / ``edge_threshold`` of the influence on the logits (tokens and
    logits always kept), circuit-tracer's ``prune_graph``.

    Example (``compute_graph_scores`` has one on a graph):
        >>> prune_graph(None, node_threshold=1.5)
        Traceback (most recent call last):
        workbench.errors.InputError: node_threshold must be between 0.0 and 1.0, got 1.5
    """
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= value <= 1.0:
            raise InputError(f"{name} must be between 0.0 and 1.0, got {value}")
    adjacency = graph.adjacency_matrix
    n_tokens, n_logits = len(graph.input_tokens), len(graph.logit_token_ids)
    n_features = len(graph.selected_features)
    logit_weights = _logit_weights(graph)
    node_influence = compute_influence(normalize_matrix(adjacency), logit_weights)
    node_mask = node_influence >= _find_threshold(node_influence, node_threshold)
    node_mask[-n_logits - n_tokens:] = True
    pruned = adjacency.clone()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    normalized_pruned = normalize_matrix(pruned)
    edge_scores = normalized_pruned * (compute_influence(normalized_pruned, logit_weights) + logit_weights)[:, None]
    edge_mask = edge_scores >= _find_threshold(edge_scores.flatten(), edge_threshold)
    sources_end = -n_logits - n_tokens
    while True:  # drop nodes left without outgoing (features, errors) or incoming (features) edges
        before = node_mask.clone()
        node_mask[:sources_end] &= edge_mask[:, :sources_end].any(0)
        node_mask[:n_features] &= edge_mask[:n_features].any(1)
        if torch.equal(node_mask, before):
            break
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
    sorted_scores, order = torch.sort(node_influence, descending=True)
    cumulative = torch.zeros_like(node_influence)
    cumulative[order] = torch.cumsum(sorted_scores, dim=0) / torch.sum(sorted_scores)
    return PruneResult(node_mask, edge_mask, cumulative)


def compute_graph_scores(graph: "AttributionGraph") -> tuple[float, float]:
    """``(replacement score, completeness score)``: the share of the tokens' and errors' influence on the logits
    that comes from tokens, and the influence-weighted share of every node's input that does not come from errors
    (circuit-tracer's ``compute_graph_scores``; 1.0 for transcoders that reconstruct the MLPs exactly).

    Example:
        >>> from experiments.attribution.graph import AttributionGraph
        >>> g = AttributionGraph("a", torch.tensor([1]), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0),
        ...     torch.zeros(0, dtype=torch.long), torch.tensor([[0., 0., 0.], [0., 0., 0.], [1., 3., 0.]]),
        ...     torch.tensor([2]), torch.ones(1), n_layers=1, vocab_size=4)   # nodes: error, token, logit
        >>> compute_graph_scores(g)
        (0.75, 0.875)
        >>> prune_graph(g).node_mask
        tensor([True, True, True])
    """
    n_tokens = len(graph.input_tokens)
    error_start = len(graph.selected_features)
    error_end = error_start + n_tokens * graph.n_layers
    logit_weights = _logit_weights(graph)
    normalized = normalize_matrix(graph.adjacency_matrix)
    node_influence = compute_influence(normalized, logit_weights)
    token_influence = node_influence[error_end:error_end + n_tokens].sum()
    error_influence = node_influence[error_start:error_end].sum()
    replacement = token_influence / (token_influence + error_influence)
    non_error = 1 - normalized[:, error_start:error_end].sum(dim=-1)
    output_influence = node_influence + logit_weights
    completeness = (non_error * output_influence).sum() / output_influence.sum()
    return replacement.item(), completeness.item()


graph_scores = compute_graph_scores
