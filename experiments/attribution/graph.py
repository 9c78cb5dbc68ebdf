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
from safetensors.torch import load_file, save_file
from torch import Tensor

from workbench.errors import CheckpointError, InputError

TENSORS = ("input_tokens", "active_features", "activation_values", "selected_features", "adjacency_matrix",
           "logit_token_ids", "logit_probabilities")
GRAPH_WEIGHTS, GRAPH_CONFIG = "graph.safetensors", "graph.json"


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
        folder.mkdir(parents=True, exist_ok=True)
        save_file({name: getattr(self, name).detach().cpu().contiguous() for name in TENSORS},
                  str(folder / GRAPH_WEIGHTS))
        meta = {"input_string": self.input_string, "n_layers": self.n_layers, "vocab_size": self.vocab_size,
                "logit_token_strings": self.logit_token_strings, "input_token_strings": self.input_token_strings,
                "scan": self.scan if isinstance(self.scan, (str, list, type(None))) else str(self.scan)}
        (folder / GRAPH_CONFIG).write_text(json.dumps(meta, indent=1) + "\n")
        return folder

    @classmethod
    def load(cls, path: Union[str, Path]) -> "AttributionGraph":
        """The graph ``save`` wrote into ``path``; missing or malformed files are a ``CheckpointError`` naming them."""
        folder = Path(path)
        try:
            meta = json.loads((folder / GRAPH_CONFIG).read_text())
            tensors = load_file(str(folder / GRAPH_WEIGHTS))
        except Exception as error:  # noqa: BLE001 - every reading failure is reported the same way
            raise CheckpointError(f"{path}: not a saved attribution graph ({error})") from None
        missing = [name for name in TENSORS if name not in tensors]
        fields = ("input_string", "n_layers", "vocab_size")
        if missing or not isinstance(meta, dict) or any(name not in meta for name in fields):
            raise CheckpointError(f"{path}: not a saved attribution graph (missing {missing or fields})")
        n = tensors["adjacency_matrix"].shape
        if len(n) != 2 or n[0] != n[1]:
            raise CheckpointError(f"{path}: adjacency_matrix must be square, got {tuple(n)}")
        return cls(**{name: tensors[name] for name in TENSORS}, input_string=str(meta["input_string"]),
                   n_layers=int(meta["n_layers"]), vocab_size=int(meta["vocab_size"]),
                   logit_token_strings=list(meta.get("logit_token_strings") or []),
                   input_token_strings=list(meta.get("input_token_strings") or []), scan=meta.get("scan"))
