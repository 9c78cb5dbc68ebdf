"""A dataset cut into shards of consecutive prompts, and the shards' per-prompt rows joined back into one table.

Legend: B batch, P position.

A dataset is an ``IOIDataset`` (shards by ``IOIDataset.select``), token ids [B, P] with an optional
``attention_mask`` (sharded alongside), or a list of texts. A shard keeps only the columns some of its
rows use (``trim``). ``mean_over_prompts`` turns per-prompt rows into the dataset-level table.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import pandas as pd
from torch import Tensor

from experiments.datasets import IOIDataset
from workbench.errors import InputError

Dataset = Union[IOIDataset, Tensor, Sequence[str]]
MAX_SHARD = 64  # default shards never exceed this many prompts (memory of one shard's caches)


def _dataset_size(dataset: Dataset, attention_mask: Optional[Tensor]) -> int:
    """The number of prompts, after checking ``dataset`` is a kind this module shards."""
    if isinstance(dataset, IOIDataset):
        n = len(dataset)
    elif isinstance(dataset, Tensor):
        if dataset.ndim != 2:
            raise InputError(f"a token dataset must be ids [batch, pos], got shape {tuple(dataset.shape)}")
        n = dataset.shape[0]
    elif isinstance(dataset, (list, tuple)) and all(isinstance(text, str) for text in dataset):
        n = len(dataset)
    else:
        raise InputError(f"dataset must be an IOIDataset, token ids [batch, pos] or a list of texts, "
                         f"got {type(dataset).__name__}")
    if n == 0:
        raise InputError("the dataset is empty: there are no prompts to shard")
    if attention_mask is not None:
        if not isinstance(dataset, Tensor):
            raise InputError("attention_mask goes with token ids [batch, pos] (an IOIDataset carries its own masks; "
                             "a list of texts builds them)")
        if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != tuple(dataset.shape):
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise InputError(f"attention_mask must have the tokens' shape {tuple(dataset.shape)}, got {shape}")
    return n


def checked_sweep(fn: Callable, dataset: Dataset, attention_mask: Optional[Tensor], shard_size: Optional[int]) -> int:
    """The number of prompts, after checking a sweep's arguments.

    Example:
        >>> checked_sweep(len, ["The cat", "The dog"], None, shard_size=1)
        2
        >>> checked_sweep(len, [], None, None)
        Traceback (most recent call last):
        ...
        workbench.errors.InputError: the dataset is empty: there are no prompts to shard
    """
    if not callable(fn):
        raise InputError(f"fn must be a callable fn(model, shard, **fn_kwargs) -> DataFrame, got {fn!r}")
    n = _dataset_size(dataset, attention_mask)
    if shard_size is not None and (isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1):
        raise InputError(f"shard_size must be a whole number of prompts >= 1, got {shard_size!r}")
    return n


def shard_payload(dataset: Dataset, attention_mask: Optional[Tensor], start: int, stop: int,
                  trim: bool) -> tuple[tuple, dict]:
    """(args, kwargs) that ``fn`` takes after the model for prompts start..stop-1.

    Example:
        >>> tokens_BP, mask_BP = torch.tensor([[5, 6, 0], [5, 6, 7]]), torch.tensor([[1, 1, 0], [1, 1, 1]])
        >>> (shard,), kwargs = shard_payload(tokens_BP, mask_BP, 0, 1, trim=True)   # the pad column dropped
        >>> shard.tolist(), kwargs["attention_mask"].tolist()
        ([[5, 6]], [[1, 1]])
    """
    if isinstance(dataset, IOIDataset):
        shard = dataset.select(slice(start, stop))
        if trim:
            used = (shard.clean_mask.bool() | shard.corrupt_mask.bool()).any(0)
            shard = dataclasses.replace(shard, **{name: getattr(shard, name)[:, used] for name in
                                                  ("clean_tokens", "clean_mask", "corrupt_tokens", "corrupt_mask")})
        return (shard,), {}
    if isinstance(dataset, Tensor):
        tokens = dataset[start:stop].cpu()
        if attention_mask is None:
            return (tokens,), {}
        mask = attention_mask[start:stop].cpu()
        if trim:
            used = mask.bool().any(0)
            tokens, mask = tokens[:, used], mask[:, used]
        return (tokens,), {"attention_mask": mask}
    return (list(dataset[start:stop]),), {}


def checked_rows(frame: Any, fn: Callable, shard: int, start: int, stop: int) -> pd.DataFrame:
    """``fn``'s result for one shard, its ``prompt`` column renumbered to dataset indices.

    Example:
        >>> checked_rows(pd.DataFrame({"prompt": [0, 1], "x": [1.0, 2.0]}), len, 3, 10, 12)["prompt"].tolist()
        [10, 11]
    """
    name = getattr(fn, "__name__", repr(fn))
    if not isinstance(frame, pd.DataFrame) or "prompt" not in frame.columns:
        raise InputError(f"{name} must return a DataFrame with a 'prompt' column (per-prompt rows numbered within "
                         f"the shard); shard {shard} gave {type(frame).__name__}"
                         f"{' with columns ' + str(list(frame.columns)) if isinstance(frame, pd.DataFrame) else ''}")
    prompts = frame["prompt"].to_numpy()
    if not np.issubdtype(prompts.dtype, np.integer) or (len(prompts) and not 0 <= prompts.min() <= prompts.max() < stop - start):
        raise InputError(f"{name}: shard {shard} holds prompts {start}..{stop - 1}, so its 'prompt' column must number "
                         f"them 0..{stop - start - 1}; got values {sorted(set(prompts.tolist()))[:8]}")
    frame = frame.copy()
    frame["prompt"] = prompts + start
    return frame


def merged_attrs(frames: list[pd.DataFrame]) -> dict:
    """Per-prompt lists in the shards' attrs (keys ending in ``_per_prompt``) joined in dataset order.

    Example:
        >>> first, second = pd.DataFrame(), pd.DataFrame()
        >>> first.attrs, second.attrs = {"clean_metric_per_prompt": [1.0], "n": 1}, {"clean_metric_per_prompt": [2.0]}
        >>> merged_attrs([first, second])
        {'clean_metric_per_prompt': [1.0, 2.0]}
    """
    keys = [key for key, value in frames[0].attrs.items() if key.endswith("_per_prompt") and isinstance(value, list)]
    return {key: [v for frame in frames for v in frame.attrs.get(key, [])] for key in keys}


def mean_over_prompts(rows: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """The mean over prompts of every other column, one row per ``by`` value in first-seen order, dtypes kept.

    Example:
        >>> rows = pd.DataFrame({"prompt": [0, 0, 1, 1], "head": [0, 1, 0, 1], "delta": [1.0, 2.0, 3.0, 6.0]})
        >>> mean_over_prompts(rows, ["head"]).values.tolist()
        [[0.0, 2.0], [1.0, 4.0]]
    """
    by = list(by)
    missing = [c for c in by + ["prompt"] if c not in rows.columns]
    if missing:
        raise InputError(f"mean_over_prompts: the rows have no column(s) {missing} (columns: {list(rows.columns)})")
    values = [c for c in rows.columns if c not in by and c != "prompt"]
    means = rows.groupby(by, sort=False)[values].mean().reset_index()
    means.attrs = {}  # the rows' attrs (sharding, per-prompt lists) do not describe the means
    return means.astype({c: rows[c].dtype for c in values if rows[c].dtype.kind == "f"})
