"""The Attribution graph page's results: the transcoder sets a model can be traced with, a set loaded once per
process, the graph of a prompt (a long run), its pruning and drawing, a feature as an SAE for the feature card,
an edge split over heads, and an intervention's logits.

A set is kept by ``st.cache_resource`` under its path, the stamp of its files and the model; results are cached on
the model's key and the set's key (``BY_KEYS``). The graph is a ``LongRun`` (its progress bar is the caller's);
what is derived from it reads it back from that store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd
import streamlit as st
import torch

import workbench as wb
from app.results.artifacts import artifact_choices, load_artifact
from app.results.features import LoadedSAE
from app.results.long_runs import LongRun, ProgressBar, no_bar
from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments.attribution import (AttributionGraph, PruneResult, attribute, compute_graph_scores, edge_heads,
                                     intervene, plan_attribution, prompt_tokens, prune_graph)
from experiments.attribution.plan import feature_nodes_within
from experiments.plots.attribution import GraphDrawing, graph_figure, node_kind, node_labels, node_place
from workbench.memory import readable_bytes

# (max_n_logits, desired_logit_prob, max_feature_nodes or 0 for all, batch_size): what a graph is built with
Settings = tuple[int, float, int, int]
# The most a graph the page builds may hold in its adjacency (with the edge buffer) and its forward copies, as
# plan_attribution counts them for the worst case (every transcoder feature active): a link can set the prompt and
# the settings, so it must not be able to make the page allocate more than this.
ATTRIBUTION_BUDGET = 1 * 2**30


@dataclass(frozen=True)
class AttributionPlan:
    """What a graph of these settings would hold (``bytes``: its adjacency and forward copies) against ``budget``;
    ``feature_nodes``: the most feature nodes that fit when it does not (0: none do; shorten the prompt)."""

    bytes: int
    budget: int
    feature_nodes: Optional[int]

    @property
    def within(self) -> bool:
        """Whether the page may build the graph."""
        return self.bytes <= self.budget

    def sizes(self) -> tuple[str, str]:
        """The planned bytes and the budget, readable ("1.5 GiB").

        Example:
            >>> AttributionPlan(3 * 2**29, 2**30, 100).sizes()
            ('1.5 GiB', '1.0 GiB')
        """
        return readable_bytes(self.bytes), readable_bytes(self.budget)


@dataclass(frozen=True)
class LoadedTranscoders:
    """A transcoder set opened for one model, with the key its results are cached under (path, stamp, model).

    Example:
        >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[None],
        ...     W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2), feature_input_hook="mlp.hook_in",
        ...     feature_output_hook="mlp.hook_out")
        >>> LoadedTranscoders(tc, "demo").key
        'demo'
    """

    transcoders: wb.TranscoderSet = field(compare=False, repr=False)
    key: str


BY_KEYS = {**BY_MODEL_KEY, LoadedTranscoders: lambda loaded_tc: loaded_tc.key}


def transcoder_choices(loaded: LoadedModel) -> dict[str, Path]:
    """The transcoder sets shipped for the open model (``app.results.artifacts``: rows of ``wb.shipped``), by
    name: the one list the page offers before "a path on this machine".

    Example:
        >>> transcoder_choices(LoadedModel(model, "no-such-model|sdpa"))
        {}
    """
    return artifact_choices(loaded, "transcoders")


def load_transcoders(loaded: LoadedModel, path: str) -> LoadedTranscoders:
    """The transcoder set at ``path`` (``wb.load_transcoders``'s formats) on the model's device, loaded once per
    process and again when its files change (``app.results.artifacts``, the one holder); load errors propagate.

    Example:
        >>> load_transcoders(LoadedModel(model, "toy-attn-2l|sdpa"), "/no/such/set")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: /no/such/set: no such file or directory (transcoders are a circuit-tracer config.yaml or its folder, a folder written by TranscoderSet.save, or SAELens transcoder directories)
    """
    held = load_artifact(loaded, "transcoders", path)
    return LoadedTranscoders(held.artifact, held.key)


@st.cache_data(show_spinner=False, max_entries=32, hash_funcs=BY_KEYS)
def fit_transcoders_error(loaded: LoadedModel, loaded_tc: LoadedTranscoders) -> Optional[str]:
    """Why the set cannot replace the model's MLPs (layers, width, hooks), or None.

    Example:
        >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[None],
        ...     W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2), feature_input_hook="mlp.hook_in",
        ...     feature_output_hook="mlp.hook_out")
        >>> fit_transcoders_error(LoadedModel(model, "toy-attn-2l|sdpa"), LoadedTranscoders(tc, "doctest-2"))
        'these transcoders cover 1 layers of width 2, the model has 2 layers of width 128'
    """
    try:
        loaded_tc.transcoders.check_model(loaded.model)
    except (wb.ConfigError, wb.InputError) as error:
        return str(error)
    return None


def attribution_plan(loaded: LoadedModel, loaded_tc: LoadedTranscoders, ids: tuple[int, ...], settings: Settings,
                     budget: Optional[int] = None) -> AttributionPlan:
    """The bytes the prompt's graph built with ``settings`` would hold in its adjacency and forward copies
    (``plan_attribution`` on the tokens ``attribute`` sees, every feature assumed active: nothing is allocated), and
    when over ``budget`` (default ``ATTRIBUTION_BUDGET``) the largest "Feature nodes" setting that fits. A prompt
    past the model's context is an ``InputError``. Not cached: it allocates nothing (a pass on the meta device).

    Example:
        >>> tc = wb.TranscoderSet(W_enc=[torch.zeros(512, 128)] * 2, b_enc=[torch.zeros(512)] * 2,
        ...     threshold=[None] * 2, W_dec=[torch.zeros(512, 1, 128)] * 2, b_dec=torch.zeros(2, 128),
        ...     feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out")
        >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=128, n_heads=2, d_vocab=300, n_ctx=256, act_fn="relu"))
        >>> plan = attribution_plan(LoadedModel(tiny, "doctest-tiny|eager"), LoadedTranscoders(tc, "doctest-plan"),
        ...                         tuple(range(1, 200)), (10, 0.95, 0, 256))
        >>> plan.within, plan.bytes > ATTRIBUTION_BUDGET, 0 < plan.feature_nodes < 2 * 512 * 199
        (False, True, True)
    """
    budget = ATTRIBUTION_BUDGET if budget is None else budget
    max_n_logits, _, max_feature_nodes, batch_size = settings
    n_tokens = len(prompt_tokens(loaded.model, list(ids)))   # as attribute sees them (BOS first)
    plan = plan_attribution(loaded.model, loaded_tc.transcoders, n_tokens, max_n_logits=max_n_logits,
                            max_feature_nodes=max_feature_nodes or None, batch_size=batch_size)
    parts = plan.set_index("part")["bytes"]
    planned = int(parts["adjacency"] + parts["forward"])
    return AttributionPlan(planned, budget, None if planned <= budget else feature_nodes_within(plan, budget))


def _attribute(model, loaded_tc: LoadedTranscoders, ids: tuple[int, ...], settings: Settings,
               progress) -> AttributionGraph:
    max_n_logits, desired_logit_prob, max_feature_nodes, batch_size = settings
    return attribute(model, loaded_tc.transcoders, list(ids), max_n_logits=max_n_logits,
                     desired_logit_prob=desired_logit_prob, max_feature_nodes=max_feature_nodes or None,
                     batch_size=batch_size, progress=progress)


_GRAPH = LongRun("Attributing the prompt: one backward pass per batch of logits and features", _attribute)


def attribution_graph(loaded: LoadedModel, loaded_tc: LoadedTranscoders, ids: tuple[int, ...], settings: Settings,
                      bar: ProgressBar) -> AttributionGraph:
    """The prompt's attribution graph (``experiments.attribution.attribute``): from this process's store, or
    computed with a progress bar.

    Example (on a page: it draws a bar):
        >>> graph = attribution_graph(loaded, loaded_tc, prompt.ids, (10, 0.95, 0, 256), bar=progress_callback)   # doctest: +SKIP
    """
    return _GRAPH(loaded, loaded_tc, ids, settings, bar=bar)


def _stored_graph(loaded: LoadedModel, loaded_tc: LoadedTranscoders, ids: tuple[int, ...],
                  settings: Settings) -> AttributionGraph:
    """The graph the page drew a bar for (stored; recomputed without a bar if the store let it go)."""
    return _GRAPH(loaded, loaded_tc, ids, settings, bar=no_bar)


@st.cache_data(show_spinner="Pruning the graph …", max_entries=32, hash_funcs=BY_KEYS)
def pruned_graph(loaded: LoadedModel, loaded_tc: LoadedTranscoders, ids: tuple[int, ...], settings: Settings,
                 node_threshold: float, edge_threshold: float) -> tuple[PruneResult, tuple[float, float]]:
    """``prune_graph`` at the two thresholds and ``compute_graph_scores`` (replacement, completeness).

    Example:
        >>> pruned, scores = pruned_graph(loaded, loaded_tc, prompt.ids, (10, 0.95, 0, 256), 0.8, 0.98)   # doctest: +SKIP
    """
    graph = _stored_graph(loaded, loaded_tc, ids, settings)
    return prune_graph(graph, node_threshold, edge_threshold), compute_graph_scores(graph)


@dataclass
class GraphNodes:
    """The graph's nodes as the page lists them: a label per node, the nodes and the feature nodes the pruning
    keeps, and each feature node's ``(layer, position, feature)``."""

    labels: list[str]
    kept: list[int]
    kept_features: list[int]
    features: dict[int, tuple[int, int, int]]


@st.cache_data(show_spinner=False, max_entries=32, hash_funcs=BY_KEYS)
def graph_nodes(loaded: LoadedModel, loaded_tc: LoadedTranscoders, ids: tuple[int, ...], settings: Settings,
                node_threshold: float, edge_threshold: float) -> GraphNodes:
    """Labels of every node (``experiments.plots.attribution.node_labels``) and the kept feature nodes.

    Example:
        >>> nodes = graph_nodes(loaded, loaded_tc, prompt.ids, (10, 0.95, 0, 256), 0.8, 0.98)   # doctest: +SKIP
    """
    graph = _stored_graph(loaded, loaded_tc, ids, settings)
    pruned, _ = pruned_graph(loaded, loaded_tc, ids, settings, node_threshold, edge_threshold)
    kept = pruned.node_mask.nonzero().flatten().tolist()
    features = {}
    for i in range(len(graph.selected_features)):
        row, position, feature = node_place(graph, i)
        features[i] = (row - 1, position, int(feature))
    return GraphNodes(node_labels(graph), kept, [i for i in kept if node_kind(graph, i) == "feature"], features)


@st.cache_data(show_spinner="Drawing the graph …", max_entries=32, hash_funcs=BY_KEYS)
def graph_drawing(loaded: LoadedModel, loaded_tc: LoadedTranscoders, ids: tuple[int, ...], settings: Settings,
                  node_threshold: float, edge_threshold: float, max_nodes: int, max_edges: int,
                  selected: Optional[int], pinned: tuple[int, ...], only_pinned: bool) -> GraphDrawing:
    """The pruned graph (or only the pinned nodes) drawn with at most ``max_nodes`` nodes and ``max_edges`` edges
    (``experiments.plots.attribution.graph_figure``).

    Example:
        >>> drawing = graph_drawing(loaded, loaded_tc, prompt.ids, (10, 0.95, 0, 256), 0.8, 0.98, 150, 400, None, (), False)   # doctest: +SKIP
    """
    graph = _stored_graph(loaded, loaded_tc, ids, settings)
    pruned, _ = pruned_graph(loaded, loaded_tc, ids, settings, node_threshold, edge_threshold)
    return graph_figure(graph, pruned, max_nodes, max_edges, selected=selected, pinned=pinned,
                        only=pinned if only_pinned else None)


@st.cache_resource(show_spinner=False, max_entries=16)
def _layer_sae(loaded_tc_key: str, layer: int, _loaded_tc: LoadedTranscoders) -> LoadedSAE:
    return LoadedSAE(_loaded_tc.transcoders.layer_sae(layer).to(_loaded_tc.transcoders.b_dec.device),
                     f"{loaded_tc_key}|layer{layer}")


def layer_sae(loaded_tc: LoadedTranscoders, layer: int) -> LoadedSAE:
    """Layer ``layer``'s transcoder as an SAE (``TranscoderSet.layer_sae``) for the Features page's card.

    Example:
        >>> tc = wb.TranscoderSet(W_enc=[torch.eye(2)], b_enc=[torch.zeros(2)], threshold=[None],
        ...     W_dec=[torch.eye(2)[:, None]], b_dec=torch.zeros(1, 2), feature_input_hook="mlp.hook_in",
        ...     feature_output_hook="mlp.hook_out")
        >>> layer_sae(LoadedTranscoders(tc, "doctest-2"), 0).key
        'doctest-2|layer0'
    """
    return _layer_sae(loaded_tc.key, layer, loaded_tc)


@st.cache_data(show_spinner="Splitting the edge over the heads …", max_entries=64, hash_funcs=BY_KEYS)
def heads_of_edge(loaded: LoadedModel, loaded_tc: LoadedTranscoders, ids: tuple[int, ...], settings: Settings,
                  target: int, source: int) -> tuple[pd.DataFrame, float, float]:
    """``edge_heads`` of one edge: (the heads table, the edge, its residual part).

    Example:
        >>> table, edge, residual = heads_of_edge(loaded, loaded_tc, prompt.ids, (10, 0.95, 0, 256), 40, 3)   # doctest: +SKIP
    """
    graph = _stored_graph(loaded, loaded_tc, ids, settings)
    with loaded.lock:
        split = edge_heads(loaded.model, loaded_tc.transcoders, graph, target, source)
    return split.table(), split.edge, split.residual


@st.cache_data(show_spinner="Running the intervention …", max_entries=64, hash_funcs=BY_KEYS)
def intervention_logits(loaded: LoadedModel, loaded_tc: LoadedTranscoders, ids: tuple[int, ...], layer: int,
                        position: int, feature: int, value: float, freeze_attention: bool, k: int) -> pd.DataFrame:
    """The last position's top ``k`` tokens (by either run) with the feature set to ``value`` (``intervene``)
    against the clean run: ``token_id``, ``token``, ``clean_logit``, ``logit``, ``change``, ``clean_prob``, ``prob``.

    Example:
        >>> intervention_logits(loaded, loaded_tc, prompt.ids, 0, 3, 7, 0.0, True, 10)   # doctest: +SKIP
    """
    with loaded.lock:
        tokens = prompt_tokens(loaded.model, list(ids))   # as the graph saw them (BOS first)
        result = intervene(loaded.model, loaded_tc.transcoders, tokens, [(layer, position, feature, value)],
                           freeze_attention=freeze_attention)
        with torch.no_grad():
            clean = loaded.model(tokens[None])[0, -1].float().cpu()
    new = result.logits[-1].float().cpu()
    top = torch.cat([clean.topk(k).indices, new.topk(k).indices]).unique()
    top = top[new[top].argsort(descending=True)]
    tokenizer = getattr(loaded.model, "tokenizer", None)
    return pd.DataFrame({
        "token_id": top.tolist(),
        "token": [tokenizer.decode([i]) if tokenizer is not None else str(i) for i in top.tolist()],
        "clean_logit": clean[top].tolist(), "logit": new[top].tolist(), "change": (new - clean)[top].tolist(),
        "clean_prob": clean.softmax(-1)[top].tolist(), "prob": new.softmax(-1)[top].tolist()})
