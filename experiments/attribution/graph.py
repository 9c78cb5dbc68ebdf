"""``AttributionGraph``: circuit-tracer's ``Graph`` fields, saved as safetensors + JSON (no pickle).

Nodes, in the adjacency's order: the selected features (``selected_features`` indexes ``active_features``), one
error node per layer and position (layer-major), one embedding node per input token, the logit nodes. Rows are
targets, columns sources; an entry is the direct effect of the source on the target in the linearised model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from jaxtyping import Float, Int
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from workbench.errors import CheckpointError, InputError
from workbench.safe_files import inside, read_json, save_files

TENSORS = ("input_tokens", "active_features", "activation_values", "selected_features", "adjacency_matrix",
           "logit_token_ids", "logit_probabilities")
GRAPH_WEIGHTS, GRAPH_CONFIG = "graph.safetensors", "graph.json"
# Each tensor's rank and whether it holds floats (else integers): what the header must declare.
LAYOUT = {"input_tokens": (1, False), "active_features": (2, False), "activation_values": (1, True),
          "selected_features": (1, False), "adjacency_matrix": (2, True), "logit_token_ids": (1, False),
          "logit_probabilities": (1, True)}
# The sizes the adjacency is made of, each read off one tensor's axis (graph.json records them at save).
SIZES = {"n_pos": ("input_tokens", 0), "n_active": ("active_features", 0), "n_selected": ("selected_features", 0),
         "n_logits": ("logit_token_ids", 0)}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
INT_DTYPES = frozenset({"I64", "I32", "I16", "I8", "U8"})
MAX_META_BYTES = 64 * 2**20  # prompt text and token strings; far above any prompt a graph can be built of


@dataclass
class AttributionGraph:
    """An attribution graph of one prompt (``experiments.attribution.attribute`` builds it).

    Example:
        >>> g = AttributionGraph(input_string="a", input_tokens=torch.tensor([1, 2]), active_features=torch.zeros(0, 3,
        ...     dtype=torch.long), activation_values=torch.zeros(0), selected_features=torch.zeros(0, dtype=torch.long),
        ...     adjacency_matrix=torch.zeros(5, 5), logit_token_ids=torch.tensor([3]), logit_probabilities=torch.ones(1),
        ...     n_layers=1, vocab_size=4)
        >>> g.n_pos, g.n_nodes, g.logit_tokens.tolist()
        (2, 5, [3])
    """

    input_string: str
    input_tokens: Int[Tensor, "pos"]
    active_features: Int[Tensor, "n_active 3"]          # (layer, position, feature)
    activation_values: Float[Tensor, "n_active"]
    selected_features: Int[Tensor, "n_selected"]        # indices into active_features, in the adjacency
    adjacency_matrix: Float[Tensor, "n_nodes n_nodes"]  # rows targets, columns sources
    logit_token_ids: Int[Tensor, "n_logits"]
    logit_probabilities: Float[Tensor, "n_logits"]
    n_layers: int
    vocab_size: int
    logit_token_strings: list[str] = field(default_factory=list)
    input_token_strings: list[str] = field(default_factory=list)
    scan: Any = None

    @property
    def logit_tokens(self) -> Int[Tensor, "n_logits"]:
        """The logit nodes' token ids (circuit-tracer's older name)."""
        return self.logit_token_ids

    @property
    def n_pos(self) -> int:
        """Prompt length."""
        return len(self.input_tokens)

    @property
    def n_nodes(self) -> int:
        """Features, errors, tokens and logits."""
        return self.adjacency_matrix.shape[0]

    def save(self, path: Union[str, Path]) -> Path:
        """Writes ``graph.safetensors`` and ``graph.json`` into directory ``path``; ``AttributionGraph.load`` reads them.

        Through ``workbench.safe_files.save_files``: both files go to temporary names and are renamed into place
        only when both are written, so a failed save leaves the previous graph loadable; a link is never written
        through. ``graph.json`` records the tensors' sizes, so a pair of files from two saves is refused on load.

        Example:
            >>> import tempfile
            >>> g = AttributionGraph("a", torch.tensor([1]), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0),
            ...     torch.zeros(0, dtype=torch.long), torch.eye(3), torch.tensor([2]), torch.ones(1), 1, 4, ["b"])
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     torch.equal(AttributionGraph.load(g.save(folder)).adjacency_matrix, g.adjacency_matrix)
            True
        """
        folder = Path(path)
        if folder.exists() and not folder.is_dir():
            raise InputError(f"{path}: exists and is not a directory")
        tensors = {name: getattr(self, name).detach().cpu().contiguous() for name in TENSORS}
        meta = {"input_string": self.input_string, "n_layers": self.n_layers, "vocab_size": self.vocab_size,
                "logit_token_strings": self.logit_token_strings, "input_token_strings": self.input_token_strings,
                "scan": self.scan if isinstance(self.scan, (str, list, type(None))) else str(self.scan),
                "sizes": {size: int(tensors[name].shape[axis]) for size, (name, axis) in SIZES.items()}}
        # The weights are renamed into place first, graph.json (which names their sizes) last.
        return save_files(folder, {GRAPH_WEIGHTS: lambda file: save_file(tensors, str(file)),
                                   GRAPH_CONFIG: lambda file: file.write_text(json.dumps(meta, indent=1) + "\n")},
                          what="graph folder")

    @classmethod
    def load(cls, path: Union[str, Path]) -> "AttributionGraph":
        """The graph ``save`` wrote into ``path``; missing or malformed files are a ``CheckpointError`` naming them.

        Checked before anything is allocated or indexed: both files inside the folder (no link out), graph.json's
        fields and types, the tensors' names, dtypes and shapes as the safetensors header declares them (the
        adjacency holds exactly the features, ``n_layers`` error rows per position, tokens and logits the other
        tensors and ``n_layers`` imply), then every index in range (features' layers and positions, token ids).

        Example:
            >>> AttributionGraph.load("no/such/graph")
            Traceback (most recent call last):
            workbench.errors.CheckpointError: no/such/graph: not a saved attribution graph (no/such/graph/graph.json: missing from the graph folder)
        """
        folder = Path(path)
        try:
            config_path = inside(folder, GRAPH_CONFIG, must_exist=True, what="graph folder")
            weights_path = inside(folder, GRAPH_WEIGHTS, must_exist=True, what="graph folder")
        except CheckpointError as error:
            raise CheckpointError(f"{path}: not a saved attribution graph ({error})") from None
        meta = _read_meta(config_path)
        tensors = _read_checked_tensors(weights_path, meta, config_path)
        return cls(**tensors, input_string=meta["input_string"], n_layers=meta["n_layers"],
                   vocab_size=meta["vocab_size"], logit_token_strings=meta["logit_token_strings"],
                   input_token_strings=meta["input_token_strings"], scan=meta["scan"])


def _read_meta(config_path: Path) -> dict[str, Any]:
    """graph.json's fields, each of its type: a ``CheckpointError`` naming the file and the field otherwise."""
    meta = read_json(config_path, MAX_META_BYTES, what="a saved attribution graph's graph.json")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{config_path}: not a saved attribution graph (a JSON object expected)")
    missing = [name for name in ("input_string", "n_layers", "vocab_size") if name not in meta]
    if missing:
        raise CheckpointError(f"{config_path}: not a saved attribution graph (missing {missing})")

    def wrong(field: str, expected: str) -> CheckpointError:
        return CheckpointError(f"{config_path}: field {field!r} must be {expected}, got {meta[field]!r:.80}")

    if not isinstance(meta["input_string"], str):
        raise wrong("input_string", "a string")
    for name in ("n_layers", "vocab_size"):
        if isinstance(meta[name], bool) or not isinstance(meta[name], int) or meta[name] < 1:
            raise wrong(name, "a positive integer")
    for name in ("logit_token_strings", "input_token_strings"):
        meta[name] = meta.get(name) or []
        if not isinstance(meta[name], list) or not all(isinstance(text, str) for text in meta[name]):
            raise wrong(name, "a list of strings")
    meta["scan"] = meta.get("scan")
    if not (meta["scan"] is None or isinstance(meta["scan"], str)
            or isinstance(meta["scan"], list) and all(isinstance(name, str) for name in meta["scan"])):
        raise wrong("scan", "a string, a list of strings or null")
    sizes = meta.get("sizes")
    if sizes is not None and (not isinstance(sizes, dict) or set(sizes) != set(SIZES) or any(
            isinstance(n, bool) or not isinstance(n, int) for n in sizes.values())):
        raise wrong("sizes", f"an object of integers {sorted(SIZES)}")
    return meta


def _read_checked_tensors(weights_path: Path, meta: dict[str, Any], config_path: Path) -> dict[str, Tensor]:
    """The graph's tensors, read only after the header's names, dtypes and shapes agree with each other and with
    graph.json; then every index is checked in range."""
    source = str(weights_path)
    try:
        with safe_open(source, framework="pt") as file:
            declared = {name: (tuple(file.get_slice(name).get_shape()), file.get_slice(name).get_dtype())
                        for name in file.keys()}
            _check_declared(declared, meta, source, config_path)
            tensors = {name: file.get_tensor(name) for name in TENSORS}
    except CheckpointError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{source}: not a saved attribution graph ({error})") from None
    _check_indices(tensors, meta, source)
    return tensors


def _check_declared(declared: dict[str, tuple[tuple[int, ...], str]], meta: dict[str, Any], source: str,
                    config_path: Path) -> None:
    missing, extra = [n for n in TENSORS if n not in declared], sorted(n for n in declared if n not in TENSORS)
    if missing or extra:
        raise CheckpointError(f"{source}: not a saved attribution graph (missing {missing}, unexpected {extra})")
    for name, (rank, floating) in LAYOUT.items():
        shape, dtype = declared[name]
        if len(shape) != rank or (dtype in FLOAT_DTYPES) != floating or not (floating or dtype in INT_DTYPES):
            kind = "floating-point" if floating else "integer"
            raise CheckpointError(f"{source}: tensor {name!r} must be a {rank}-D {kind} tensor, got {dtype} "
                                  f"{list(shape)}")
    sizes = {size: declared[name][0][axis] for size, (name, axis) in SIZES.items()}
    if declared["active_features"][0][1] != 3:
        raise CheckpointError(f"{source}: tensor 'active_features' must be [n_active, 3] (layer, position, "
                              f"feature), got {list(declared['active_features'][0])}")
    for name, size in (("activation_values", "n_active"), ("logit_probabilities", "n_logits")):
        if declared[name][0][0] != sizes[size]:
            raise CheckpointError(f"{source}: tensor {name!r} has {declared[name][0][0]} entries, {size} is "
                                  f"{sizes[size]}")
    n_nodes = declared["adjacency_matrix"][0]
    n_pos, n_layers = sizes["n_pos"], meta["n_layers"]
    expected = sizes["n_selected"] + (n_layers + 1) * n_pos + sizes["n_logits"]
    if n_pos < 1 or n_nodes[0] != n_nodes[1] or n_nodes[0] != expected:
        raise CheckpointError(f"{config_path}: n_layers={n_layers} with {n_pos} positions, {sizes['n_selected']} "
                              f"features and {sizes['n_logits']} logits needs a {expected}x{expected} adjacency; "
                              f"{source} holds {list(n_nodes)}")
    if meta.get("sizes") is not None and meta["sizes"] != sizes:
        raise CheckpointError(f"{config_path}: records sizes {meta['sizes']} but {source} holds {sizes}: the two "
                              "files are from different saves")


def _check_indices(tensors: dict[str, Tensor], meta: dict[str, Any], source: str) -> None:
    n_active, n_pos = len(tensors["active_features"]), len(tensors["input_tokens"])
    bounds = (("selected_features", tensors["selected_features"], n_active, "n_active"),
              ("active_features' layers", tensors["active_features"][:, 0], meta["n_layers"], "n_layers"),
              ("active_features' positions", tensors["active_features"][:, 1], n_pos, "the prompt's length"),
              ("active_features' features", tensors["active_features"][:, 2], None, None),
              ("input_tokens", tensors["input_tokens"], meta["vocab_size"], "vocab_size"),
              ("logit_token_ids", tensors["logit_token_ids"], meta["vocab_size"], "vocab_size"))
    for what, values, bound, bound_name in bounds:
        if len(values) and (int(values.min()) < 0 or bound is not None and int(values.max()) >= bound):
            limit = f"in [0, {bound_name}={bound})" if bound is not None else "non-negative"
            raise CheckpointError(f"{source}: {what} must be {limit}, got {int(values.min())}..{int(values.max())}")
