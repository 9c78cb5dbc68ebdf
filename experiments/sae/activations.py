"""Training activations in bounded memory: streamed from the model batch by batch or read from a cache on disk,
then mixed in a shuffling buffer.

Legend: B batch, P position, N flattened tokens, i d_in.

A row of activations holds the hooks' widths side by side (a transcoder's input then its target); ``I`` below
stands for that width.

``activation_chunks`` yields, for ``batch_size`` token rows at a time (cycling over the rows for several
passes), the activations of the hooks asked for at the positions kept (special tokens, e.g. BOS with its huge
norm, left out as SAELens's ``exclude_special_tokens``). From the model it is ``run_with_cache`` with a
``names_filter`` and ``stop_at_layer`` (only the layers up to the deepest hook run); from a cache it reads the
shards that ``model.run_with_cache(..., cache_dir=...)`` wrote, a chunk at a time, each directory first opened
with ``workbench.load_cache`` (the checked reader: index, shard files and headers, model sizes) and its rows read
through the cache's checked row-range reader (``ShardedActivations.read_rows``). ``ShuffleBuffer`` is SAELens's
mixing buffer: fill to ``capacity`` rows, shuffle, serve half, keep half; its state (the rows it holds, the token
rows consumed, the generator) is what a checkpoint saves, so a resumed run serves the same batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor

from workbench.cache_store import ShardedActivations, load_cache
from workbench.errors import InputError


def special_token_ids(model) -> list[int]:
    """The tokenizer's BOS, EOS and pad ids (what ``exclude_special_tokens`` leaves out), deduplicated.

    Example:
        >>> special_token_ids(model) == sorted({model.tokenizer.bos_token_id, model.tokenizer.eos_token_id})
        True
    """
    tok = getattr(model, "tokenizer", None)
    ids = {getattr(tok, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")} if tok else set()
    return sorted(i for i in ids if i is not None)


def kept_positions(tokens: Int[Tensor, "B P"], exclude: Sequence[int]) -> Tensor:
    """Boolean [B, P]: the positions whose token is not in ``exclude``.

    Example:
        >>> kept_positions(torch.tensor([[0, 5, 6, 0]]), [0])
        tensor([[False,  True,  True, False]])
    """
    keep = torch.ones(tokens.shape, dtype=torch.bool)
    for token in exclude:
        keep &= tokens.cpu() != token
    return keep


def activation_chunks(model, tokens: Int[Tensor, "B P"], hook_names: Sequence[str], batch_size: int,
                      stop_at_layer: Optional[int], exclude: Sequence[int] = (), start_row: int = 0,
                      cache_dirs: Optional[Sequence[Union[str, Path]]] = None, outlier_norm_ratio: Optional[float] = None,
                      ) -> Iterator[tuple[int, Float[Tensor, "N i"]]]:
    """``(token rows consumed so far, activations [N, W])`` for each ``batch_size`` token rows from ``start_row``
    on (row ``r`` is ``tokens[r % B]``: it cycles forever), the hooks' activations concatenated along the width.

    From ``cache_dirs`` (directories written by ``model.run_with_cache(tokens, cache_dir=...)``, their rows in
    order being ``tokens``'s) when given, else from the model (``run_with_cache`` with ``names_filter`` and
    ``stop_at_layer``, no gradients). ``outlier_norm_ratio``: rows where a hook's activation norm exceeds this
    many times its median over the chunk are left out (massive activations: SmolLM2's residual stream carries
    norms 50x the median at a few tokens, which would dominate the MSE).

    Example:
        >>> tokens = torch.randint(1, 100, (4, 8))
        >>> chunks = activation_chunks(model, tokens, ["blocks.0.hook_resid_post"], 2, stop_at_layer=1)
        >>> [(rows, acts.shape) for rows, acts in (next(chunks), next(chunks), next(chunks))]
        [(2, torch.Size([16, 128])), (4, torch.Size([16, 128])), (6, torch.Size([16, 128]))]
    """
    n_rows = tokens.shape[0]
    keep = kept_positions(tokens, exclude)
    caches = _open_caches(model, cache_dirs, hook_names, tuple(tokens.shape)) if cache_dirs else None
    row = start_row
    while True:
        rows = [(row + i) % n_rows for i in range(batch_size)]
        if caches is not None:
            acts = _read_rows(caches, hook_names, rows)
        else:
            with torch.no_grad():
                _, cache = model.run_with_cache(tokens[rows], names_filter=list(hook_names), stop_at_layer=stop_at_layer,
                                                return_type=None)
            acts = [cache[name].detach().float().cpu() for name in hook_names]
        row += batch_size
        kept = [a[keep[rows]] for a in acts]
        if outlier_norm_ratio is not None and len(kept[0]):
            ordinary = torch.stack([not_outliers(a, outlier_norm_ratio) for a in kept]).all(0)
            kept = [a[ordinary] for a in kept]
        yield row, torch.cat(kept, dim=-1)


def not_outliers(acts: Float[Tensor, "N i"], ratio: float) -> Tensor:
    """Boolean [N]: the rows whose norm is at most ``ratio`` times the median norm.

    Example:
        >>> not_outliers(torch.tensor([[1.0], [1.2], [0.9], [50.0]]), 10.0)
        tensor([ True,  True,  True, False])
    """
    norms = acts.float().norm(dim=-1)
    return norms <= ratio * norms.median()


def _open_caches(model, cache_dirs: Sequence[Union[str, Path]], hook_names: Sequence[str],
                 tokens_shape: tuple[int, int]) -> list[tuple[int, ShardedActivations]]:
    """(first row, the directory's stored activations) of each cache directory, rows numbered across them in order.
    Each is opened with ``workbench.load_cache``, the checked reader (index fields, shard files inside the
    directory, every shard's header against the index, the model's sizes), before any activation is read."""
    table, offset = [], 0
    for directory in map(Path, cache_dirs):
        try:
            stored = load_cache(directory, model, device="cpu").cache_dict
        except InputError as error:
            raise InputError(f"activation_cache: {error}") from None
        index = stored.index
        missing = [name for name in hook_names if name not in index["names"]]
        if missing:
            raise InputError(f"activation_cache: {directory} holds no activations of {missing} (it has {index['names']})")
        for name in hook_names:
            shape = index["shapes"][name]
            if len(shape) != 3 or shape[1] != tokens_shape[1]:
                raise InputError(f"activation_cache: {directory}'s {name!r} is {shape}; training needs [rows, "
                                 f"pos={tokens_shape[1]}, width] (data's positions)")
        table.append((offset, stored))
        offset += index["rows"]
    if offset != tokens_shape[0]:
        raise InputError(f"activation_cache holds {offset} rows but data has {tokens_shape[0]} token rows (the cache "
                         "must be of exactly these rows, in order)")
    return table


def _read_rows(caches: list[tuple[int, ShardedActivations]], hook_names: Sequence[str],
               rows: list[int]) -> list[Tensor]:
    """Each hook's activations [len(rows), P, D] (float32) for the given rows, in their order: each run of
    consecutive rows read with the cache's checked row-range reader (``ShardedActivations.read_rows``)."""
    runs, parts = [], []
    for row in rows:
        if runs and row == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([row, row + 1])
    for start, stop in runs:
        for offset, stored in caches:
            low, high = max(start, offset), min(stop, offset + stored.index["rows"])
            if low < high:
                try:
                    parts.append(stored.read_rows(hook_names, low - offset, high - offset))
                except InputError as error:
                    raise InputError(f"activation_cache: {error}") from None
    return [torch.cat([part[name] for part in parts]).float() for name in hook_names]


class ShuffleBuffer:
    """SAELens's mixing buffer over ``chunks`` (``activation_chunks``): holds at most ``capacity`` rows plus one
    chunk; when full it shuffles and moves half to the rows served next, ``batch_rows`` at a time.

    Example:
        >>> chunks = ((i + 1, torch.full((4, 1), float(i))) for i in range(100))
        >>> buffer = ShuffleBuffer(chunks, capacity=16, batch_rows=4, generator=torch.Generator().manual_seed(0))
        >>> batch = buffer.next_batch()
        >>> batch.shape, buffer.rows_consumed, len(buffer.storage) <= 16
        (torch.Size([4, 1]), 4, True)
    """

    def __init__(self, chunks: Iterator[tuple[int, Tensor]], capacity: int, batch_rows: int,
                 generator: torch.Generator, state: Optional[dict[str, Any]] = None):
        self.chunks, self.capacity, self.batch_rows, self.generator = chunks, capacity, batch_rows, generator
        self.storage = torch.empty(0)  # rows waiting to be mixed
        self.ready = torch.empty(0)    # mixed rows, served from the front
        self.rows_consumed = 0         # token rows the chunks so far came from
        if state is not None:
            self.storage, self.ready, self.rows_consumed = state["storage"], state["ready"], int(state["rows_consumed"])
            self.generator.set_state(state["generator"])

    def next_batch(self) -> Float[Tensor, "batch_rows i"]:
        """The next ``batch_rows`` mixed rows."""
        self.peek(self.batch_rows)
        batch, self.ready = self.ready[:self.batch_rows], self.ready[self.batch_rows:]
        return batch

    def peek(self, n_rows: int) -> Float[Tensor, "n_rows i"]:
        """The next ``n_rows`` mixed rows, left in place (mixing more in as needed)."""
        while len(self.ready) < n_rows:
            self.rows_consumed, chunk = next(self.chunks)
            self.storage = chunk if not len(self.storage) else torch.cat([self.storage, chunk])
            if len(self.storage) >= self.capacity:
                self.storage = self.storage[torch.randperm(len(self.storage), generator=self.generator)]
                half = len(self.storage) // 2
                served, self.storage = self.storage[:half], self.storage[half:]
                self.ready = served if not len(self.ready) else torch.cat([self.ready, served])
        return self.ready[:n_rows]

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves to resume exactly here."""
        return {"storage": self.storage.clone(), "ready": self.ready.clone(), "rows_consumed": self.rows_consumed,
                "generator": self.generator.get_state()}
