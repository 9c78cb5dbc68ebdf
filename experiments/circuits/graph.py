"""The computational graph circuits are found in: writers into the residual stream, readers of it, and the edges.

Legend: O circuit writers, I circuit readers, P position, B batch, H n_heads, D d_model.

In a pre-norm decoder the residual stream a component reads is a plain sum of what earlier components
wrote (plus constants: biases, positions), so the contribution of each writer to each later reader is an
edge that can be scored and patched on its own (Conmy et al. 2023; Hanna et al. 2024 name nodes this way):

- writers: ``input`` (the token embedding: the residual stream entering block 0, positions and an
  embedding norm included), ``a{l}.h{h}`` (head h's output, ``attn.hook_result``), ``m{l}`` (the MLP's
  output, ``hook_mlp_out``; a mixture of experts is one MLP node);
- readers: ``a{l}.h{h}<q>`` / ``<k>`` / ``<v>`` (the head's own copy of its query, key and value input,
  ``hook_q_input`` ... under ``use_split_qkv_input``; a grouped-query model is ungrouped so each query head
  has its own key and value input), ``m{l}`` (``hook_mlp_in``), ``logits`` (the last ``hook_resid_post``).

Every writer feeds every later reader: a layer's heads feed its MLP unless attention and MLP run in
parallel (GPT-J, NeoX), where they feed later layers only. Writers are numbered in the order they run, so the
writers feeding reader r are writers ``0 .. n_before[r] - 1`` and the edge set is a [O, I] mask. Blocks whose
outputs are normalised before they join the residual stream (post-norm, sandwich and sublayer-output norms)
have no such sum and are refused by name, as is latent attention (its heads share one key/value input).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence, Union

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from workbench.errors import InputError

EMBED_HOOK = "blocks.0.hook_resid_pre"  # the embedding writer: everything that enters block 0
QKV = ("q", "k", "v")
EdgeLike = Union[str, tuple[str, str]]


@dataclass(frozen=True)
class CircuitGraph:
    """The writer and reader nodes of a model, the hook each one lives at, and which writers feed which reader.

    Example:
        >>> graph = circuit_graph(model)                                  # toy-attn-2l: 2 layers x 4 heads, no MLPs
        >>> graph.writers[:3], graph.readers[-1], graph.n_edges
        (['input', 'a0.h0', 'a0.h1'], 'logits', 81)
        >>> graph.edge_name(*graph.edge_index("a0.h0->a1.h1<k>"))
        'a0.h0->a1.h1<k>'
    """

    n_layers: int
    n_heads: int
    has_mlp: bool
    parallel_attn_mlp: bool

    @cached_property
    def writers(self) -> list[str]:
        names = ["input"]
        for layer in range(self.n_layers):
            names += [f"a{layer}.h{head}" for head in range(self.n_heads)] + ([f"m{layer}"] if self.has_mlp else [])
        return names

    @cached_property
    def readers(self) -> list[str]:
        names = []
        for layer in range(self.n_layers):
            names += [f"a{layer}.h{head}<{kind}>" for kind in QKV for head in range(self.n_heads)]
            names += [f"m{layer}"] if self.has_mlp else []
        return names + ["logits"]

    @property
    def per_layer_writers(self) -> int:
        return self.n_heads + int(self.has_mlp)

    def first_writer(self, layer: int) -> int:
        """Index of layer ``layer``'s first writer (its head 0); ``n_layers`` gives the number of writers."""
        return 1 + layer * self.per_layer_writers

    def first_reader(self, layer: int) -> int:
        """Index of layer ``layer``'s first reader (head 0's query); ``n_layers`` gives the logits reader."""
        return layer * (3 * self.n_heads + int(self.has_mlp))

    @cached_property
    def n_before(self) -> Int[Tensor, "readers"]:
        """How many writers feed each reader: writers 0 .. n_before[r] - 1 do."""
        counts = []
        for layer in range(self.n_layers):
            counts += [self.first_writer(layer)] * (3 * self.n_heads)
            if self.has_mlp:
                counts.append(self.first_writer(layer) + (0 if self.parallel_attn_mlp else self.n_heads))
        return torch.tensor(counts + [len(self.writers)])

    @cached_property
    def edge_mask(self) -> Bool[Tensor, "writers readers"]:
        """True where writer w feeds reader r."""
        return torch.arange(len(self.writers))[:, None] < self.n_before[None, :]

    @property
    def n_edges(self) -> int:
        return int(self.edge_mask.sum())

    @cached_property
    def _writer_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.writers)}

    @cached_property
    def _reader_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.readers)}

    def writer_index(self, name: str) -> int:
        if name not in self._writer_index:
            raise InputError(f"{name!r} is not a writer of this model's graph: writers are 'input', 'a{{l}}.h{{h}}' and "
                             f"'m{{l}}' (layers 0..{self.n_layers - 1}, heads 0..{self.n_heads - 1})")
        return self._writer_index[name]

    def reader_index(self, name: str) -> int:
        if name not in self._reader_index:
            raise InputError(f"{name!r} is not a reader of this model's graph: readers are 'a{{l}}.h{{h}}<q>' / <k> / <v>, "
                             f"'m{{l}}' and 'logits' (layers 0..{self.n_layers - 1}, heads 0..{self.n_heads - 1})")
        return self._reader_index[name]

    def edge_index(self, edge: EdgeLike) -> tuple[int, int]:
        """(writer, reader) indices of ``"writer->reader"`` or a (writer, reader) pair; an error if it is no edge."""
        writer, reader = edge.split("->") if isinstance(edge, str) and "->" in edge else (edge if not isinstance(edge, str)
                                                                                           else (edge, ""))
        w, r = self.writer_index(writer.strip()), self.reader_index(reader.strip())
        if not bool(self.edge_mask[w, r]):
            raise InputError(f"{writer}->{reader} is not an edge: {writer} does not run before {reader} reads")
        return w, r

    def edge_name(self, w: int, r: int) -> str:
        return f"{self.writers[w]}->{self.readers[r]}"

    def edges_mask(self, edges: Sequence[EdgeLike]) -> Bool[Tensor, "writers readers"]:
        """The [O, I] mask holding ``edges`` (names or (writer, reader) pairs).

        Example:
            >>> int(circuit_graph(model).edges_mask(["input->logits", ("a0.h0", "a1.h1<k>")]).sum())
            2
        """
        mask = torch.zeros(len(self.writers), len(self.readers), dtype=torch.bool)
        for edge in edges:
            mask[self.edge_index(edge)] = True
        return mask

    def edge_names(self, mask: Bool[Tensor, "writers readers"]) -> list[str]:
        """The names of the edges in ``mask``, writer-major."""
        return [self.edge_name(w, r) for w, r in mask.nonzero().tolist()]

    def reader_site(self, r: int) -> tuple[str, Optional[int]]:
        """(hook name, head or None) of reader ``r``'s input."""
        name = self.readers[r]
        if name == "logits":
            return f"blocks.{self.n_layers - 1}.hook_resid_post", None
        layer, rest = _layer_of(name)
        if name.startswith("m"):
            return f"blocks.{layer}.hook_mlp_in", None
        head, kind = rest.split("<")
        return f"blocks.{layer}.hook_{kind[0]}_input", int(head[1:])

    def writer_site(self, w: int) -> tuple[str, Optional[int]]:
        """(hook name, head or None) of writer ``w``'s output."""
        name = self.writers[w]
        if name == "input":
            return EMBED_HOOK, None
        layer, rest = _layer_of(name)
        if name.startswith("m"):
            return f"blocks.{layer}.hook_mlp_out", None
        return f"blocks.{layer}.attn.hook_result", int(rest[1:])

    def node_of(self, name: str) -> str:
        """The component a writer or reader belongs to: ``a1.h2<q>`` -> ``a1.h2``."""
        return name.split("<")[0]


def _layer_of(name: str) -> tuple[int, str]:
    first, _, rest = name.partition(".")
    return int(first[1:]), rest


def circuit_graph(model) -> CircuitGraph:
    """The edge graph of ``model``, or an ``InputError`` naming what keeps its heads' outputs from summing.

    Example:
        >>> circuit_graph(model).n_layers
        2
    """
    cfg = model.cfg
    if cfg.norm_placement != "pre":
        raise InputError(f"circuits need pre-norm blocks, whose heads' and MLPs' outputs are summed into the residual "
                         f"stream; this model's norm_placement is {cfg.norm_placement!r} (its sublayer outputs are "
                         f"normalised before or after the sum), so an edge has no separate contribution to patch")
    if cfg.is_latent_attention:
        raise InputError("circuits need each head's own query, key and value input; latent attention (kv_lora_rank) "
                         "shares one key/value latent between heads")
    return CircuitGraph(cfg.n_layers, cfg.n_heads, not cfg.attn_only, bool(cfg.parallel_attn_mlp))
