"""Residual-stream rows read out through the final norm and unembedding as each row's top-k logits, ids and logsumexp,
a block of rows at a time, on helper threads while the caller goes on producing rows.

Legend: N flattened tokens, D d_model, V d_vocab.

``TopLogitsReader`` is the one implementation behind ``Decoder.top_logits_from_resid`` (every row handed in at once)
and the logit lens read during the forward pass (``experiments.lens.logit_lens_with_cache``: a forward hook hands
in each snapshot as the pass reaches it, and the snapshots of the first layers are read while the later layers run).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

import torch
from jaxtyping import Float, Int
from torch import Tensor

from workbench.components.embedding import logsumexp
from workbench.errors import InputError

if TYPE_CHECKING:
    from workbench.model import Decoder

# Rows read out at a time: a block's logits (64 x d_vocab floats, 12.6 MB at 49k tokens) stay in cache while they are
# screened, ranked and summed, and no [rows, d_vocab] matrix is ever held (SmolLM2's 31 snapshots of 64 tokens:
# 390 MB); on one CPU thread 64-row blocks ran the bfloat16 screen 1.6x faster than 1,984 rows.
READOUT_ROWS_PER_BLOCK = 64

Readout = tuple[Float[Tensor, "rows top"], Int[Tensor, "rows top"], Float[Tensor, "rows"]]


class TopLogitsReader:
    """Reads the rows handed to ``add`` in blocks of ``READOUT_ROWS_PER_BLOCK``: each full block is read at once by one
    of ``workers - 1`` helper threads (none for one worker), and ``result`` reads what no helper has started on the
    calling thread, beside the helpers, then returns every row's readout in the order the rows came.

    ``screen_dtype`` None: exact logits; bfloat16: screened (``Unembed.screened_top_k``). Each thread runs torch with
    its intra-op thread count, in the grad mode of the thread that made the reader. The readout of a row does not
    depend on the worker count or on how the rows were split between ``add`` calls (the blocks are the same).
    Use it as a context manager, or call ``result``: either ends the helpers.

    Example:
        >>> resid = cache["blocks.1.hook_resid_post"][0]
        >>> with TopLogitsReader(model, 3, workers=2) as reader:
        ...     reader.add(resid[:5]); reader.add(resid[5:])   # rows as they come
        ...     values, ids, lse = reader.result()
        >>> torch.equal(ids, model.top_logits_from_resid(resid, 3)[1])
        True
    """

    def __init__(self, model: "Decoder", k: int, screen_dtype: Optional[torch.dtype] = None, workers: int = 1) -> None:
        if workers < 1:
            raise InputError(f"workers must be at least 1, got {workers}")
        if k < 1:
            raise InputError(f"k must be at least 1, got {k}")
        self._model, self._k, self._screen_dtype = model, k, screen_dtype
        if screen_dtype is not None:
            model.unembed.screen_weight(screen_dtype)  # converted once here, not by each thread
        self._grad = torch.is_grad_enabled()  # grad mode is per thread: the helpers take the maker's
        self._pool = ThreadPoolExecutor(max_workers=workers - 1) if workers > 1 else None
        self._waiting: list[Tensor] = []  # rows not yet in a full block, none of them empty
        self._blocks: list[tuple[Tensor, Optional[Future]]] = []  # each block, and its helper's run when handed out

    def add(self, resid_ND: Float[Tensor, "rows d_model"]) -> None:
        """Hands in rows (residual streams after the last block, or the snapshot a logit lens reads); every block they
        fill goes to a helper at once. The rows are read later: the caller must not write into them meanwhile."""
        if resid_ND.ndim != 2 or resid_ND.shape[-1] != self._model.cfg.d_model:
            raise InputError(f"rows must be [rows, d_model={self._model.cfg.d_model}], got {tuple(resid_ND.shape)}")
        if resid_ND.shape[0]:
            self._waiting.append(resid_ND)
        while sum(rows.shape[0] for rows in self._waiting) >= READOUT_ROWS_PER_BLOCK:
            rows_ND = torch.cat(self._waiting) if len(self._waiting) > 1 else self._waiting[0]
            self._hand_out(rows_ND[:READOUT_ROWS_PER_BLOCK])
            self._waiting = [rows_ND[READOUT_ROWS_PER_BLOCK:]] if rows_ND.shape[0] > READOUT_ROWS_PER_BLOCK else []

    def result(self) -> Readout:
        """Every row's ``k`` highest logits (float32), their ids and the row's logsumexp, in the order the rows came;
        the blocks no helper has started are read here. Ends the helpers."""
        try:
            if self._waiting:  # the last, short block
                self._hand_out(torch.cat(self._waiting), to_helper=False)
                self._waiting = []
            if not self._blocks:
                raise InputError("no rows were handed in to read")
            # The blocks no helper has started first, here, then those the helpers are reading.
            read_here = [self._read(rows_ND) if run is None or run.cancel() else None for rows_ND, run in self._blocks]
            parts = [mine if mine is not None else run.result() for mine, (_, run) in zip(read_here, self._blocks)]
        finally:
            self.close()
        values_Nk, ids_Nk, lse_N = (torch.cat(each) for each in zip(*parts))
        return values_Nk, ids_Nk, lse_N

    def close(self) -> None:
        """Ends the helpers (a block one has started is finished first); the rows not read are dropped."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "TopLogitsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _hand_out(self, rows_ND: Tensor, to_helper: bool = True) -> None:
        run = self._pool.submit(self._read, rows_ND) if to_helper and self._pool is not None else None
        self._blocks.append((rows_ND, run))

    def _read(self, rows_ND: Tensor) -> Readout:
        model, k = self._model, self._k
        with torch.set_grad_enabled(self._grad):
            normed_ND = model.apply_final_norm(rows_ND)
            if self._screen_dtype is not None:
                return model.unembed.screened_top_k(normed_ND, k, self._screen_dtype)
            logits_NV = model.unembed(normed_ND).float()
            return (*logits_NV.topk(min(k, logits_NV.shape[-1]), dim=-1), logsumexp(logits_NV))
