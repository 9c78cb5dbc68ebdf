"""The importance tables of ``experiments.flow``, each attention sum's row filled when it is first read.

Legend: L n_layers, P position, S key position, H n_heads.

Splitting an attention sum (layer l, target i) into its parts costs i * H * d_model per row, and the graph from one
token at the default threshold reads about a tenth of the rows: ``FlowTables`` holds every table at its full shape,
fills a row of the attention sums (sources by head, residual, bias, and a parallel block's MLP, which shares their
sum) the first time ``ensure`` asks for it, and keeps it. The sequential MLP sums are cheap and come filled.
Reading a table whole (``complete``) fills the rest: the numbers are the same whichever rows were asked for first.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Optional

import torch
from jaxtyping import Float
from torch import Tensor

# fill(layer, targets) -> (attn [t, S, H], resid [t], bias [t], parallel MLP [t] or None) for those target positions
RowFiller = Callable[[int, list[int]], tuple[Tensor, Tensor, Tensor, Optional[Tensor]]]


class FlowTables:
    """Every part's importance in its sum (see ``experiments.flow.FlowContributions``), attention rows on demand.

    ``attn_LPSH``, ``attn_resid_LP``, ``attn_bias_LP`` (and ``mlp_LP`` of a parallel block) hold the rows filled so
    far (``filled_LP``); ``mlp_LP`` / ``mlp_resid_LP`` of sequential blocks are whole from the start.

    Example:
        >>> tables = FlowTables.from_tables(torch.ones(1, 2, 2, 1) / 4, torch.full((1, 2), 0.5), torch.zeros(1, 2))
        >>> bool(tables.filled_LP.all()), tables.attn_LPSH.shape
        (True, torch.Size([1, 2, 2, 1]))
    """

    def __init__(self, shape_LPSH: tuple[int, int, int, int], parallel: bool, fill: Optional[RowFiller],
                 mlp_LP: Optional[Tensor] = None, mlp_resid_LP: Optional[Tensor] = None):
        L, P, S, H = shape_LPSH
        self.attn_LPSH: Float[Tensor, "n_layers pos key_pos n_heads"] = torch.zeros(L, P, S, H)
        self.attn_resid_LP: Float[Tensor, "n_layers pos"] = torch.zeros(L, P)
        self.attn_bias_LP: Float[Tensor, "n_layers pos"] = torch.zeros(L, P)
        self.mlp_LP: Optional[Tensor] = torch.zeros(L, P) if parallel else mlp_LP
        self.mlp_resid_LP: Optional[Tensor] = mlp_resid_LP
        self.filled_LP = torch.zeros(L, P, dtype=torch.bool)
        self._fill, self._lock = fill, threading.Lock()  # the app's store shares one table between sessions

    @classmethod
    def from_tables(cls, attn_LPSH: Tensor, attn_resid_LP: Tensor, attn_bias_LP: Tensor,
                    mlp_LP: Optional[Tensor] = None, mlp_resid_LP: Optional[Tensor] = None,
                    parallel: bool = False) -> "FlowTables":
        """Tables given whole (a hand-made example, a test): every row filled.

        Example:
            >>> FlowTables.from_tables(torch.zeros(2, 3, 3, 4), torch.ones(2, 3), torch.zeros(2, 3)).attn_LPSH.shape
            torch.Size([2, 3, 3, 4])
        """
        tables = cls(tuple(attn_LPSH.shape), parallel, None, None if parallel else mlp_LP, mlp_resid_LP)
        tables.attn_LPSH, tables.attn_resid_LP, tables.attn_bias_LP = attn_LPSH, attn_resid_LP, attn_bias_LP
        if parallel:
            tables.mlp_LP = mlp_LP
        tables.filled_LP[:] = True
        return tables

    def ensure(self, layer: int, targets: Iterable[int]) -> "FlowTables":
        """Fills the attention sums of ``layer`` at the ``targets`` positions not filled yet; returns the tables.

        Example:
            >>> tables = FlowTables.from_tables(torch.zeros(1, 2, 2, 1), torch.ones(1, 2), torch.zeros(1, 2))
            >>> tables.ensure(0, [1]).attn_resid_LP[0, 1].item()
            1.0
        """
        with self._lock:
            missing = sorted({int(i) for i in targets if not self.filled_LP[layer, int(i)]})
            if not missing:
                return self
            attn_tSH, resid_t, bias_t, mlp_t = self._fill(layer, missing)
            rows = torch.tensor(missing)
            self.attn_LPSH[layer, rows] = attn_tSH.cpu()
            self.attn_resid_LP[layer, rows] = resid_t.cpu()
            self.attn_bias_LP[layer, rows] = bias_t.cpu()
            if mlp_t is not None:
                self.mlp_LP[layer, rows] = mlp_t.cpu()
            self.filled_LP[layer, rows] = True
        return self

    def complete(self) -> "FlowTables":
        """Fills every row not filled yet (the tables read whole); returns the tables.

        Example:
            >>> FlowTables.from_tables(torch.zeros(1, 2, 2, 1), torch.ones(1, 2), torch.zeros(1, 2)).complete().filled_LP
            tensor([[True, True]])
        """
        L, P = self.filled_LP.shape
        for layer in range(L):
            self.ensure(layer, range(P))
        return self
