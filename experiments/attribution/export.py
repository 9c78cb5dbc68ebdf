"""The pruned graph as the JSON circuit-tracer's and Neuronpedia's viewers read (circuit-tracer 0.5's
``utils/create_graph_files.py`` and ``frontend/graph_models.py``, field for field).

Node ids are circuit-tracer's: a feature ``{layer}_{feature}_{pos}``, an error ``0_{layer}_{pos}``, a token
``E_{token_id}_{pos}``, a logit ``{n_layers + 1}_{token_id}_{last pos}``; a feature's ``feature`` is the Cantor
pairing of its layer and index. Links are the kept edges, ordered by target then source; nodes are the kept ones
that a kept edge touches, plus every token and logit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from experiments.attribution.graph import AttributionGraph
from experiments.attribution.influence import prune_graph
from workbench.errors import InputError
from workbench.safe_files import inside, read_json, save_files

SCHEMA_VERSION = 1
INDEX_FILE = "graph-metadata.json"  # the viewer's list of the folder's graphs
MAX_INDEX_BYTES = 64 * 2**20


def _node(node_id: str, feature: int, layer: str, ctx_idx: int, feature_type: str, js_node_id: str,
          influence: Optional[float] = None, activation: Optional[float] = None, token_prob: float = 0.0,
          is_target_logit: bool = False, clerp: str = "") -> dict[str, Any]:
    return {"node_id": node_id, "feature": feature, "layer": layer, "ctx_idx": ctx_idx, "feature_type": feature_type,
            "token_prob": token_prob, "is_target_logit": is_target_logit, "run_idx": 0, "reverse_ctx_idx": 0,
            "jsNodeId": js_node_id, "clerp": clerp, "influence": influence, "activation": activation}


def _cantor(x: int, y: int) -> int:
    return (x + y) * (x + y + 1) // 2 + y


def graph_nodes(graph: AttributionGraph, node_mask: Any, cumulative_scores: Any) -> dict[int, dict[str, Any]]:
    """The viewer's node record of every node ``node_mask`` keeps, by adjacency index.

    Example:
        >>> import torch
        >>> g = AttributionGraph("a", torch.tensor([1]), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0),
        ...     torch.zeros(0, dtype=torch.long), torch.zeros(3, 3), torch.tensor([2]), torch.ones(1), 1, 4, ["b"], ["a"])
        >>> [node["node_id"] for node in graph_nodes(g, torch.ones(3, dtype=torch.bool), torch.zeros(3)).values()]
        ['0_0_0', 'E_1_0', '2_2_0']
    """
    n_features, n_pos, n_layers = len(graph.selected_features), graph.n_pos, graph.n_layers
    error_end = n_features + n_pos * n_layers
    token_end = error_end + n_pos
    nodes = {}
    for index in node_mask.nonzero().flatten().tolist():
        score = float(cumulative_scores[index])
        if index < n_features:
            active = int(graph.selected_features[index])
            layer, pos, feature = graph.active_features[active].tolist()
            nodes[index] = _node(f"{layer}_{feature}_{pos}", _cantor(layer, feature), str(layer), pos,
                                 "cross layer transcoder", f"{layer}_{feature}-0", influence=score,
                                 activation=float(graph.activation_values[active]))
        elif index < error_end:
            layer, pos = divmod(index - n_features, n_pos)
            nodes[index] = _node(f"0_{layer}_{pos}", -1, str(layer), pos, "mlp reconstruction error",
                                 f"{layer}_{pos}-0", influence=score)
        elif index < token_end:
            pos = index - error_end
            token = int(graph.input_tokens[pos])
            nodes[index] = _node(f"E_{token}_{pos}", pos, "E", pos, "embedding", f"E_{token}-{pos}", influence=score)
        else:
            rank = index - token_end
            token, prob = int(graph.logit_token_ids[rank]), float(graph.logit_probabilities[rank])
            text = graph.logit_token_strings[rank] if rank < len(graph.logit_token_strings) else str(token)
            layer = str(n_layers + 1)
            nodes[index] = _node(f"{layer}_{token}_{n_pos - 1}", token, layer, n_pos - 1, "logit",
                                 f"L_{token}-{n_pos - 1}", token_prob=prob, is_target_logit=rank == 0,
                                 clerp=f'Output "{text}" (p={prob:.3f})')
    return nodes


def graph_json(graph: AttributionGraph, slug: str, node_threshold: float = 0.8, edge_threshold: float = 0.98,
               scan: Any = None) -> dict[str, Any]:
    """The viewer's JSON of ``graph`` pruned at ``node_threshold`` / ``edge_threshold`` (``scan`` names the
    transcoders; default the graph's).

    Example:
        >>> import torch
        >>> g = AttributionGraph("a", torch.tensor([1]), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0),
        ...     torch.zeros(0, dtype=torch.long), torch.tensor([[0., 0., 0.], [0., 0., 0.], [1., 3., 0.]]),
        ...     torch.tensor([2]), torch.ones(1), 1, 4, ["b"], ["a"], scan="mine")
        >>> [(link["source"], link["target"]) for link in graph_json(g, "demo")["links"]]
        [('0_0_0', '2_2_0'), ('E_1_0', '2_2_0')]
    """
    scan = graph.scan if scan is None else scan
    if scan is None:
        raise InputError("graph_json needs scan (which transcoders made the graph): pass scan= or set graph.scan")
    pruned = prune_graph(graph, node_threshold, edge_threshold)
    nodes = graph_nodes(graph, pruned.node_mask, pruned.cumulative_scores)
    targets, sources = pruned.edge_mask.nonzero(as_tuple=True)
    weights = graph.adjacency_matrix[targets, sources].tolist()
    links = [{"source": nodes[s]["node_id"], "target": nodes[t]["node_id"], "weight": w}
             for t, s, w in zip(targets.tolist(), sources.tolist(), weights) if s in nodes and t in nodes]
    connected = {link["source"] for link in links} | {link["target"] for link in links}
    used = [node for node in nodes.values()
            if node["node_id"] in connected or node["feature_type"] in ("embedding", "logit")]
    if isinstance(scan, list):  # circuit-tracer names a list of transcoders by a hash of it
        transcoder_list, scan = scan, "custom-" + str(hash("-".join(scan)))
    else:
        transcoder_list = []
    metadata = {"slug": slug, "scan": scan, "transcoder_list": transcoder_list,
                "prompt_tokens": list(graph.input_token_strings), "prompt": graph.input_string,
                "node_threshold": node_threshold, "schema_version": SCHEMA_VERSION}
    return {"metadata": metadata,
            "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
            "nodes": used, "links": links}


def write_graph_files(graph: AttributionGraph, slug: str, output_path: Union[str, Path], node_threshold: float = 0.8,
                      edge_threshold: float = 0.98, scan: Any = None) -> Path:
    """Writes ``{slug}.json`` into folder ``output_path`` and adds its metadata to ``graph-metadata.json`` there
    (replacing a graph of the same slug), as circuit-tracer's ``create_graph_files`` does. Returns the JSON's path.

    Both files are written through ``workbench.safe_files.save_files`` (temporary names renamed into place, no
    link written through): a failed write leaves the folder as it was. A slug naming the index itself, or a path,
    is refused.

    Example:
        >>> import tempfile, torch
        >>> g = AttributionGraph("a", torch.tensor([1]), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0),
        ...     torch.zeros(0, dtype=torch.long), torch.zeros(3, 3), torch.tensor([2]), torch.ones(1), 1, 4, ["b"],
        ...     ["a"], scan="mine")
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     write_graph_files(g, "demo", folder).name
        'demo.json'
    """
    folder = Path(output_path)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{output_path}: exists and is not a directory")
    if (not isinstance(slug, str) or not slug or "/" in slug or "\\" in slug or slug.startswith(".")
            or "\0" in slug):
        raise InputError(f"slug must be a plain file name (no path separators, not starting with '.'), got {slug!r}")
    graph_name = f"{slug}.json"
    if graph_name == INDEX_FILE:
        raise InputError(f"slug {slug!r} would write over the viewer's index {INDEX_FILE}; choose another")
    index = _read_index(folder)
    data = graph_json(graph, slug, node_threshold, edge_threshold, scan)
    graphs = [g for g in index["graphs"] if isinstance(g, dict) and g.get("slug") != slug]
    index = {**index, "graphs": graphs + [data["metadata"]]}
    # The graph is renamed into place before the index that lists it.
    save_files(folder, {graph_name: lambda file: file.write_text(json.dumps(data, indent=2)),
                        INDEX_FILE: lambda file: file.write_text(json.dumps(index, indent=2))},
               what="graph files folder")
    return folder / graph_name


def _read_index(folder: Path) -> dict[str, Any]:
    """The folder's ``graph-metadata.json`` (``{"graphs": []}`` when there is none), read inside the folder only;
    an unreadable or malformed one is an ``InputError`` naming it (it is never silently replaced)."""
    index_path = inside(folder, INDEX_FILE, what="graph files folder")
    if not index_path.exists():
        return {"graphs": []}
    index = read_json(index_path, MAX_INDEX_BYTES, what="a graph index", error=InputError)
    if not isinstance(index, dict) or not isinstance(index.get("graphs", []), list):
        raise InputError(f"{index_path}: not a graph index (an object whose 'graphs' is a list)")
    return {**index, "graphs": index.get("graphs", [])}
