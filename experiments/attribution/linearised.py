"""The linearised forward pass of the replacement model and its direct-effect rows (circuit-tracer's method).

``LinearisedForward`` runs ``batch`` copies of the prompt through ``ReplacementModel``'s frozen model
(``replacement.py``: every attention pattern and norm divisor detached, each MLP's output replaced by
``skip + (output - skip).detach()``, so its value is unchanged but the only gradient through it is the
transcoders' linear skip term). In that graph every path from a source to a target is linear. ``rows`` injects
one target's read direction per batch row (an encoder row at a feature's input hook, a logit's unembedding
direction at the final norm's output) as the gradient and contracts the gradients at each output hook and at
``hook_embed`` (captured by ``experiments.gradients.GradientCapture``) with the sources' written vectors (``ReplacementModel.read_sources``): each result is the direct
effect of a source on a target.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from jaxtyping import Float, Int
from torch import Tensor

from experiments.attribution.replacement import ReplacementModel, Sources
from experiments.gradients import GradientCapture
from workbench.transcoders import TranscoderSet

__all__ = ["LinearisedForward", "Sources", "read_sources"]


def read_sources(model: Any, transcoders: Optional[TranscoderSet], tokens: Int[Tensor, "pos"]) -> Sources:
    """Every source node of the graph on ``tokens``: ``ReplacementModel.read_sources``.

    Example:
        >>> moe = wb.load_model("toy-moe-2l", progress=False)
        >>> sources = read_sources(moe, wb.load_transcoders("toy-moe-2l-clt"), moe.to_tokens("def f(x):")[0])
        >>> sources.active_features.shape[1]   # each active feature's (layer, position, feature)
        3
    """
    return ReplacementModel.of(model, transcoders).read_sources(tokens)


class LinearisedForward:
    """``batch`` copies of the prompt through the frozen model, kept for repeated backward passes (``rows``).
    ``model`` is a ``ReplacementModel`` (``transcoders`` None) or a model with its ``transcoders``."""

    def __init__(self, model: Any, transcoders: Optional[TranscoderSet], tokens: Int[Tensor, "pos"],
                 sources: Optional[Sources], batch: int):
        self.replacement = ReplacementModel.of(model, transcoders)
        model, transcoders = self.replacement.model, self.replacement.transcoders
        self.transcoders, self.sources = transcoders, sources
        self.n_layers, self.n_pos, self.batch = transcoders.n_layers, tokens.shape[0], batch
        self.n_features = 0 if sources is None else sources.active_features.shape[0]   # None: plan_attribution
        self.resid: dict[int, Tensor] = {}        # read points: layer -> input hook's tensor; n_layers -> final norm
        # write points: each MLP output's replacement (in the graph through its skip term, else a leaf), then the
        # token embedding, a leaf (nothing before it is a source)
        self.write_names = [transcoders.output_hook(l) for l in range(self.n_layers)] + ["hook_embed"]
        self.capture = GradientCapture(self.write_names, cut=["hook_embed"])
        self._blocks: dict[int, tuple[Tensor, Tensor]] = {}
        with torch.enable_grad(), model.hooks(fwd_hooks=self._hooks() + self.capture.hooks()):
            # stop before the unembedding (its [batch, pos, d_vocab] logits are never needed); the final norm's
            # output, its divisor frozen by the hooks, is where logit targets read
            resid = model(tokens[None].expand(batch, -1), stop_at_layer=self.n_layers)
            self.resid[self.n_layers] = model.apply_final_norm(resid)

    def _hooks(self) -> list:
        replacement = self.replacement

        def read(layer: int):
            def hook(acts: Tensor, hook: Any) -> Tensor:
                self.resid[layer] = acts
                return acts
            return hook

        def write(layer: int):
            def hook(acts: Tensor, hook: Any) -> Tensor:
                return replacement.mlp_output(layer, self.resid[layer], acts)
            return hook

        tc = self.transcoders
        return replacement.freeze_hooks() + [(tc.input_hook(l), read(l)) for l in range(self.n_layers)] + \
            [(tc.output_hook(l), write(l)) for l in range(self.n_layers)]

    @property
    def row_size(self) -> int:
        """Columns of a row: features, errors (layer-major), tokens."""
        return self.n_features + (self.n_layers + 1) * self.n_pos

    def rows(self, layers: Int[Tensor, "target"], positions: Int[Tensor, "target"], inject: Float[Tensor, "target d_model"],
             retain_graph: bool = True) -> Float[Tensor, "target row"]:
        """The direct effects on ``k`` targets (read at ``layers`` — ``n_layers`` for a logit — and ``positions``
        along ``inject``) of every source: one backward pass per ``batch`` targets, one batch row per target."""
        k = layers.shape[0]
        chunks = [self._rows(layers[start:start + self.batch], positions[start:start + self.batch],
                             inject[start:start + self.batch], retain_graph or start + self.batch < k)
                  for start in range(0, k, self.batch)]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def _rows(self, layers: Int[Tensor, "target"], positions: Int[Tensor, "target"], inject: Float[Tensor, "target d_model"],
              retain_graph: bool) -> Float[Tensor, "target row"]:
        k = layers.shape[0]
        layers, positions = layers.cpu(), positions.cpu()   # CPU indices serve tensors on any device
        outputs, grads = [], []
        for layer in layers.unique().tolist():
            mask = layers == layer
            tensor = self.resid[layer]
            grad = torch.zeros_like(tensor)
            grad[torch.arange(k)[mask], positions[mask]] = inject[mask].to(grad.dtype)
            outputs.append(tensor)
            grads.append(grad)
        found = self.capture.gradients(outputs, grads, retain_graph=retain_graph)
        return self._contract([found[name] for name in self.write_names], k)

    def _decoder_blocks(self, layer: int) -> tuple[Tensor, Tensor]:
        """The decoder rows writing to ``layer`` laid out by position, ``[pos, m, d_model]`` zero-padded to the most
        at one position, and the feature each belongs to ``[pos, m]`` (``n_features``, a scratch column, for padding).
        Built once per layer: a batch's contraction is then one batched matmul over positions, never a gather of the
        gradients per decoder row ([k, rows, d_model])."""
        if layer not in self._blocks:
            src = self.sources
            rows = (src.decoder_layer == layer).nonzero().flatten()
            positions = src.decoder_pos[rows]
            order = positions.argsort(stable=True)
            rows, positions = rows[order], positions[order]
            counts = torch.bincount(positions, minlength=self.n_pos)
            width = int(counts.max()) if len(rows) else 0
            slot = torch.arange(len(rows), device=rows.device) - (counts.cumsum(0) - counts)[positions]
            vecs = torch.zeros(self.n_pos, width, src.decoder_vecs.shape[1], dtype=src.decoder_vecs.dtype,
                               device=src.decoder_vecs.device)
            owner = torch.full((self.n_pos, width), self.n_features, dtype=torch.long, device=rows.device)
            vecs[positions, slot] = src.decoder_vecs[rows]
            owner[positions, slot] = src.decoder_source[rows]
            self._blocks[layer] = (vecs, owner)
        return self._blocks[layer]

    def _contract(self, grads: list[Tensor], k: int) -> Float[Tensor, "target row"]:
        src, n_pos = self.sources, self.n_pos
        row = torch.zeros(k, self.row_size + 1, dtype=src.error_vecs.dtype, device=src.error_vecs.device)
        error_start = self.n_features
        for layer in range(self.n_layers):
            grad = grads[layer][:k].to(row.dtype)
            vecs_PMD, owner_PM = self._decoder_blocks(layer)
            if owner_PM.shape[1]:
                per_slot_PKM = torch.bmm(grad.transpose(0, 1), vecs_PMD.transpose(1, 2))
                row.index_add_(1, owner_PM.flatten(), per_slot_PKM.permute(1, 0, 2).reshape(k, -1))
            start = error_start + layer * n_pos
            row[:, start:start + n_pos] = torch.einsum("kpd,pd->kp", grad, src.error_vecs[layer])
        start = error_start + self.n_layers * n_pos
        row[:, start:start + n_pos] = torch.einsum("kpd,pd->kp", grads[-1][:k].to(row.dtype), src.token_vecs)
        return row[:, :-1]
