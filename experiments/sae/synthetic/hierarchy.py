"""Feature hierarchies (SAELens 6.54's ``sae_lens.synthetic.hierarchy``): a child fires only when its parent does
(or, with ``scale_children_by_parent``, is scaled by ``parent / parent_mean``), and the children of a mutually
exclusive node keep one active child per sample, chosen at random (the same ``torch.rand`` call as SAELens, level by
level, so a seed gives SAELens's samples).

Legend: B batch.
``num_features`` in shapes is the number of ground-truth features.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from workbench.errors import ConfigError, InputError


class HierarchyNode:
    """One feature (``feature_index``; None for a grouping node) and the features that depend on it.

    Example:
        >>> tree = HierarchyNode(0, [HierarchyNode(1), HierarchyNode(2)], mutually_exclusive_children=True)
        >>> tree.get_all_feature_indices()
        [0, 1, 2]
    """

    def __init__(self, feature_index: Optional[int] = None, children: Optional[Sequence["HierarchyNode"]] = None,
                 mutually_exclusive_children: bool = False, scale_children_by_parent: bool = False,
                 feature_id: Optional[str] = None):
        self.feature_index = feature_index
        self.children = list(children or [])
        self.mutually_exclusive_children = mutually_exclusive_children
        self.scale_children_by_parent = scale_children_by_parent
        self.feature_id = feature_id
        if mutually_exclusive_children and len(self.children) < 2:
            raise InputError("a mutually exclusive node needs at least 2 children")

    @classmethod
    def from_dict(cls, tree: dict[str, Any]) -> "HierarchyNode":
        """A tree from its JSON form (``feature_index``, ``children``, ``mutually_exclusive_children``,
        ``scale_children_by_parent``, ``feature_id`` or ``id``).

        Example:
            >>> node = HierarchyNode.from_dict({"feature_index": 0, "children": [{"feature_index": 1}]})
            >>> node.children[0].feature_index
            1
        """
        if not isinstance(tree, dict):
            raise ConfigError(f"a hierarchy node is a JSON object; got {type(tree).__name__}")
        return cls(feature_index=tree.get("feature_index"),
                   children=[cls.from_dict(child) for child in tree.get("children", [])],
                   mutually_exclusive_children=tree.get("mutually_exclusive_children", False),
                   scale_children_by_parent=tree.get("scale_children_by_parent", False),
                   feature_id=tree.get("feature_id", tree.get("id")))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form SAELens saves (``hierarchy.json``)."""
        return {"feature_index": self.feature_index, "mutually_exclusive_children": self.mutually_exclusive_children,
                "scale_children_by_parent": self.scale_children_by_parent, "feature_id": self.feature_id,
                "children": [child.to_dict() for child in self.children]}

    def get_all_feature_indices(self) -> list[int]:
        """This subtree's feature indices, depth first."""
        own = [self.feature_index] if self.feature_index is not None else []
        return own + [index for child in self.children for index in child.get_all_feature_indices()]


@dataclass
class HierarchyConfig:
    """SAELens's knobs for ``generate_hierarchy`` (its defaults).

    Example:
        >>> HierarchyConfig(total_root_nodes=2, branching_factor=3).max_depth
        2
    """

    total_root_nodes: int = 100
    branching_factor: Union[int, tuple[int, int]] = 100
    max_depth: int = 2
    mutually_exclusive_portion: float = 0.0
    mutually_exclusive_min_depth: int = 0
    mutually_exclusive_max_depth: Optional[int] = None
    compensate_probabilities: bool = False
    scale_children_by_parent: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.branching_factor, list):
            self.branching_factor = tuple(self.branching_factor)
        low, high = ((self.branching_factor,) * 2 if isinstance(self.branching_factor, int)
                     else self.branching_factor)
        if self.total_root_nodes <= 0 or low < 2 or low > high or self.max_depth < 1:
            raise ConfigError("HierarchyConfig needs total_root_nodes > 0, a branching factor >= 2 (min <= max) and "
                              "max_depth >= 1")
        if not 0 <= self.mutually_exclusive_portion <= 1:
            raise ConfigError("mutually_exclusive_portion must be between 0 and 1")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (a branching range as a list)."""
        out = asdict(self)
        out["branching_factor"] = (self.branching_factor if isinstance(self.branching_factor, int)
                                   else list(self.branching_factor))
        return out


@dataclass
class Hierarchy:
    """A forest of ``HierarchyNode`` trees and the modifier applying it.

    Example:
        >>> h = Hierarchy.from_dict({"roots": [{"feature_index": 0, "children": [{"feature_index": 1}]}]})
        >>> h.modifier(torch.tensor([[0.0, 1.0], [2.0, 1.0]]))
        tensor([[0., 0.],
                [2., 1.]])
    """

    roots: list[HierarchyNode]
    modifier: Optional[Callable[..., Tensor]]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Hierarchy":
        """From SAELens's ``hierarchy.json`` (``{"roots": [...]}``)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("roots"), list):
            raise ConfigError("a hierarchy file holds {\"roots\": [...]}")
        roots = [HierarchyNode.from_dict(root) for root in raw["roots"]]
        return cls(roots=roots, modifier=hierarchy_modifier(roots) if roots else None)

    def to_dict(self) -> dict[str, Any]:
        """SAELens's ``hierarchy.json`` form."""
        return {"roots": [root.to_dict() for root in self.roots]}

    def compute_probability_correction_factors(self, base_firing_probabilities: Tensor) -> Tensor:
        """Factors restoring each feature's base firing rate under its ancestors' gating and its siblings' exclusion
        (``1 / p_parent``, times ``1 + sum(other siblings' p) / p_parent`` in a mutually exclusive group)."""
        factors = torch.ones(base_firing_probabilities.shape[0], dtype=base_firing_probabilities.dtype)

        def traverse(node: HierarchyNode, parent_prob: float) -> None:
            node_prob = parent_prob
            if node.feature_index is not None:
                if parent_prob > 0:
                    factors[node.feature_index] = 1.0 / parent_prob
                node_prob = base_firing_probabilities[node.feature_index].item()
            for child in node.children:
                traverse(child, node_prob)
            if node.mutually_exclusive_children and len(node.children) >= 2:
                probs = [(c.feature_index, base_firing_probabilities[c.feature_index].item())
                         for c in node.children if c.feature_index is not None]
                if len(probs) >= 2 and node_prob > 0:
                    total = sum(p for _, p in probs)
                    for index, p in probs:
                        factors[index] *= 1.0 + max(0.0, total - p) / node_prob

        for root in self.roots:
            traverse(root, 1.0)
        return factors


def generate_hierarchy(num_features: int, config: HierarchyConfig, seed: Optional[int] = None) -> Hierarchy:
    """Trees built breadth first over features ``0, 1, ...`` (SAELens's algorithm and ``random.Random(seed)`` calls).

    Example:
        >>> h = generate_hierarchy(7, HierarchyConfig(total_root_nodes=1, branching_factor=2), seed=0)
        >>> h.roots[0].get_all_feature_indices()
        [0, 1, 3, 4, 2, 5, 6]
    """
    rng = random.Random(seed)
    counter = iter(range(num_features))
    roots = [HierarchyNode(index) for _, index in zip(range(config.total_root_nodes), counter)]
    parents = [(root, 0) for root in roots]
    level = list(parents)
    while level:
        next_level = []
        for node, depth in level:
            if depth >= config.max_depth:
                continue
            branching = (config.branching_factor if isinstance(config.branching_factor, int)
                         else rng.randint(*config.branching_factor))
            for _, index in zip(range(branching), counter):
                child = HierarchyNode(index)
                node.children.append(child)
                if depth + 1 < config.max_depth:
                    next_level.append((child, depth + 1))
                    parents.append((child, depth + 1))
        level = next_level
    eligible = [node for node, depth in parents if depth >= config.mutually_exclusive_min_depth
                and (config.mutually_exclusive_max_depth is None or depth <= config.mutually_exclusive_max_depth)
                and len(node.children) >= 2]
    count = int(len(eligible) * config.mutually_exclusive_portion)
    if count > 0:
        for i in set(rng.sample(range(len(eligible)), count)):
            eligible[i].mutually_exclusive_children = True
    if config.scale_children_by_parent:
        for node, _ in parents:
            node.scale_children_by_parent = True
    return Hierarchy(roots=roots, modifier=hierarchy_modifier(roots) if roots else None)


def _check_forest(roots: Sequence[HierarchyNode]) -> None:
    """No loops, one parent per node, no feature in two trees."""
    seen: set[int] = set()
    features: set[int] = set()

    def visit(node: HierarchyNode, ancestors: frozenset) -> None:
        if id(node) in ancestors:
            raise InputError(f"hierarchy loop at feature {node.feature_index}")
        if id(node) in seen:
            raise InputError(f"hierarchy node (feature {node.feature_index}) has more than one parent")
        seen.add(id(node))
        for child in node.children:
            visit(child, ancestors | {id(node)})

    for root in roots:
        visit(root, frozenset())
        indices = set(root.get_all_feature_indices())
        if indices & features:
            raise InputError(f"features {sorted(indices & features)} appear in more than one hierarchy tree")
        features |= indices


def hierarchy_modifier(roots: Union[HierarchyNode, Sequence[HierarchyNode]]) -> Callable[..., Tensor]:
    """An ``ActivationGenerator`` modifier applying the trees level by level: gate (or scale) each level by its
    parents, then resolve the mutually exclusive groups whose parent sits at that level.

    Example:
        >>> modifier = hierarchy_modifier(HierarchyNode(0, [HierarchyNode(1), HierarchyNode(2)]))
        >>> modifier(torch.tensor([[0.0, 1.0, 1.0]]))
        tensor([[0., 0., 0.]])
    """
    roots = [roots] if isinstance(roots, HierarchyNode) else list(roots)
    if not roots:
        return lambda activations: activations
    _check_forest(roots)
    features, groups = [], []  # (feature, parent, level, parent rescales); (level, parent, siblings)
    queue = deque((root, -1, 0, False) for root in roots)
    while queue:
        node, parent, level, rescales = queue.popleft()
        if node.feature_index is not None:
            features.append((node.feature_index, parent, level, rescales))
            parent = node.feature_index
        siblings = [c.feature_index for c in node.children if c.feature_index is not None]
        if node.mutually_exclusive_children and len(siblings) >= 2:
            groups.append((level, node.feature_index if node.feature_index is not None else -1, siblings))
        queue.extend((child, parent, level + 1, node.scale_children_by_parent) for child in node.children)
    any_rescale = any(f[3] for f in features)
    levels = range(max([f[2] for f in features] + [g[0] for g in groups] + [-1]) + 1)
    gates, exclusions = [], []  # per level, built once: (children, parents, rescaled) and (siblings, parents)
    for level in levels:
        gated = [(f, p, r) for f, p, lv, r in features if lv == level and p >= 0]
        gates.append(tuple(torch.tensor(column, dtype=dtype) for column, dtype in
                           zip(zip(*gated), (torch.long, torch.long, torch.bool))) if gated else None)
        exclusions.append(_group_table([g for g in groups if g[0] == level]))
    rescale_parents = torch.tensor(sorted({p for _, p, _, r in features if r and p >= 0}), dtype=torch.long)

    def modifier(activations: Tensor, generator: Any = None) -> Tensor:
        sparse = activations.is_sparse  # applied densely; SAELens's COO path draws the same winners differently
        result = activations.to_dense().clone() if sparse else activations.clone()
        device = result.device
        means = generator.mean_firing_magnitudes.to(device) if any_rescale else None
        if means is not None and not (means[rescale_parents.to(device)] > 0).all():
            raise InputError("mean_firing_magnitudes must be > 0 for parents with scale_children_by_parent=True")
        for gate, exclusion in zip(gates, exclusions):
            if gate is not None:
                kids, dads, mask = (t.to(device) for t in gate)
                parent_vals, child_vals = result[:, dads], result[:, kids]
                active = parent_vals > 0
                if any_rescale:
                    scaled = torch.where(active, parent_vals / means[dads], torch.zeros_like(parent_vals))
                    result[:, kids] = child_vals * torch.where(mask, scaled, active.to(child_vals.dtype))
                else:
                    result[:, kids] = child_vals * active
            if exclusion is not None:
                _exclude(result, *(t.to(device) for t in exclusion))
        return result.to_sparse() if sparse else result

    if any_rescale:
        return lambda activations, generator: modifier(activations, generator)
    return lambda activations: modifier(activations)


def _group_table(groups: list[tuple[int, int, list[int]]]) -> Optional[tuple[Tensor, Tensor]]:
    """Mutually exclusive groups as ``siblings [groups, widest]`` (-1 padded) and their ``parents [groups]``."""
    if not groups:
        return None
    siblings = torch.full((len(groups), max(len(g[2]) for g in groups)), -1, dtype=torch.long)
    for i, (_, _, members) in enumerate(groups):
        siblings[i, :len(members)] = torch.tensor(members)
    return siblings, torch.tensor([g[1] for g in groups], dtype=torch.long)


def _exclude(acts: Tensor, siblings: Tensor, parents: Tensor) -> None:
    """Keeps one random active sibling per sample and group whose parent is active (in place; SAELens's draw)."""
    groups, width = siblings.shape
    valid = siblings >= 0
    active = (acts[:, siblings.clamp(min=0).view(-1)].view(acts.shape[0], groups, width) > 0) & valid
    if (parents >= 0).any():
        active &= ((acts[:, parents.clamp(min=0)] > 0) | (parents < 0)).unsqueeze(2)
    batch, group = torch.where(active.sum(dim=2) > 1)
    if batch.numel() == 0:
        return
    conflict_active = active[batch, group]
    scores = torch.rand(batch.numel(), width, device=acts.device)
    scores[~conflict_active] = -1e9
    winner = torch.zeros_like(conflict_active).scatter_(1, scores.argmax(dim=1, keepdim=True), True)
    conflict, slot = torch.where(conflict_active & ~winner)
    acts[batch[conflict], siblings[group[conflict], slot]] = 0
