"""``run_with_cache`` over a dataset in bounded memory, and ``cache_size``.

Legend: B batch, P position, D d_model, V d_vocab.

``Decoder.run_with_cache(..., batch_size=N)`` (or ``cache_dir=``) comes here. The rows run N at a
time, cached through ``workbench.hook_point.caching``. Each batch's activations are either copied into
tensors for all B rows, allocated once the first batch has shown their shapes, or, with
``cache_dir``, written to disk as one safetensors shard (``workbench.cache_store``) and dropped.
Before anything for all B rows is allocated, the bytes the run would hold are checked against the
memory free on the target device (``CacheTooLargeError``). The output is what one pass would give:
logits, per-token losses or residual streams concatenated over the rows; the mean loss as the sum
over every batch's scored tokens divided by their count.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens import ActivationCache

from workbench.cache_store import ShardWriter, load_cache
from workbench.errors import CacheTooLargeError, InputError
from workbench.hook_point import caching
from workbench.loss import next_token_loss
from workbench.memory import readable_bytes
from workbench.tokens_api import TextOrTokens, check_attention_mask
from workbench.host import DecoderHost


RETURN_TYPES = ("logits", "loss", "both", None)
# TransformerLens's run_with_cache options that have no meaning when the rows run in batches.
_ONE_PASS_ONLY = {"incl_bwd": "caching gradients needs one backward pass over the whole batch",
                  "remove_batch_dim": "it drops the batch axis the batches are joined along (index cache[name][0])",
                  "kv_cache": "a KV cache belongs to one batch of sequences"}


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes free for new tensors on ``device``: CUDA's free memory plus what PyTorch holds reserved
    but unused; for the CPU, the kernel's MemAvailable (through psutil when installed). None where
    it cannot be told (then nothing is checked). ``run_with_cache`` calls it through this module,
    so tests can replace it.

    Example:
        >>> available_memory(torch.device("cpu")) > 0
        True
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        import psutil
    except ImportError:
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                fields = dict(line.split(":", 1) for line in meminfo if ":" in line)
            return int(fields["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return None
    return psutil.virtual_memory().available


def available_disk(directory: Path) -> int:
    """Bytes free on the file system holding ``directory`` (replaceable in tests, as ``available_memory``).

    Example:
        >>> available_disk(Path(".")) > 0
        True
    """
    return shutil.disk_usage(directory).free


def cache_size(model: DecoderHost, tokens: TextOrTokens, names_filter: Any = None,
               attention_mask: Optional[Int[Tensor, "batch pos"]] = None) -> int:
    """Bytes that ``model.run_with_cache(tokens, names_filter=..., attention_mask=...)`` would cache,
    found by running one row only (``tokens[:1]`` at the full width): each selected hook's shape and
    dtype are recorded, nothing is kept, and the batch axis (every hook's first) is scaled to all rows.

    ``names_filter`` as in ``run_with_cache`` (None: every hook). A list of texts is padded as
    ``run_with_cache`` pads it. Compare the result with ``available_memory`` or pick a
    ``batch_size`` from it.

    Example:
        >>> wb.cache_size(model, tokens, names_filter=lambda n: n.endswith("hook_pattern"))   # doctest: +SKIP
        2097152
    """
    tokens_BP, mask_BP = model.as_tokens_and_mask(tokens, attention_mask=attention_mask)
    seen = _ShapeRecorder()
    with torch.no_grad(), caching(model.hook_dict, model.cached_names(names_filter), seen):
        model(tokens_BP[:1], return_type=None, attention_mask=None if mask_BP is None else mask_BP[:1])
    _check_batch_first({name: shape for name, (shape, _) in seen.items()}, 1)
    return tokens_BP.shape[0] * sum(math.prod(shape[1:]) * dtype.itemsize for shape, dtype in seen.values())


class _ShapeRecorder(dict):
    """A cache sink that keeps each tensor's shape and dtype instead of the tensor."""

    def __setitem__(self, name: str, tensor: Tensor) -> None:
        super().__setitem__(name, (tuple(tensor.shape), tensor.dtype))


def run_with_cache_in_batches(
    model: DecoderHost,
    input: Union[TextOrTokens, Float[Tensor, "batch pos d_model"]],
    return_type: Optional[str] = "logits",
    *,
    batch_size: Optional[int] = None,
    device: Union[None, str, torch.device] = None,
    cache_dir: Union[None, str, Path] = None,
    progress: bool = True,
    names_filter: Any = None,
    pos_slice: Any = None,
    reset_hooks_end: bool = True,
    clear_contexts: bool = False,
    attention_mask: Optional[Int[Tensor, "batch pos"]] = None,
    padding_side: str = "right",
    prepend_bos: Optional[bool] = None,
    loss_per_token: bool = False,
    tokens: Optional[Int[Tensor, "batch pos"]] = None,
    start_at_layer: Optional[int] = None,
    stop_at_layer: Optional[int] = None,
    **forward_kwargs: Any,
) -> tuple[Any, ActivationCache]:
    """``run_with_cache`` with the rows run ``batch_size`` at a time (what ``Decoder.run_with_cache``
    calls when given ``batch_size`` or ``cache_dir``).

    Each batch's activations go to ``device`` (default: the model's) and are joined along the batch
    axis, or with ``cache_dir`` are written there as one shard each and the returned cache reads
    them back lazily (``workbench.cache_store.load_cache``). ``cache_dir`` must be new or empty.
    ``batch_size`` None: all rows in one batch. Forward arguments (``attention_mask``,
    ``return_type``, ``loss_per_token``, ``start_at_layer``, ...) are the model's; ``attention_mask``
    and, from a residual stream, ``tokens`` are split with the rows. The output is on ``device`` and
    carries no gradient. A ``CacheTooLargeError`` after the first batch when what the run would hold
    in memory (or write to disk) exceeds what is free; on any error (a hook raising, a full disk,
    Ctrl-C) the hooks are removed and the shards and directory this call made are deleted.

    Example:
        >>> logits, cache = run_with_cache_in_batches(model, tokens, batch_size=8)   # doctest: +SKIP
    """
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise InputError(f"batch_size must be a positive integer (rows per batch), got {batch_size!r}")
    if return_type not in RETURN_TYPES:
        raise InputError(f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")
    for option, why in _ONE_PASS_ONLY.items():
        if forward_kwargs.pop(option, None):
            raise InputError(f"run_with_cache cannot take {option} with batch_size or cache_dir: {why}")
    rows, mask_BP, targets_BP = _split_inputs(model, input, attention_mask, padding_side, prepend_bos, tokens,
                                              start_at_layer)
    if return_type in ("loss", "both") and stop_at_layer is None and targets_BP is None:
        raise InputError("the loss needs token ids: pass tokens= when starting from a residual stream")
    B = rows.shape[0]
    batch_size = min(batch_size or B, B)
    if not reset_hooks_end:
        raise InputError("run_with_cache cannot take reset_hooks_end=False with batch_size or cache_dir: the rows "
                         "run in batches within the call, so nothing is left to cache afterwards")
    target = torch.device(device if device is not None else model.cfg.device)
    is_cached, chunk_cache = model.cached_names(names_filter), {}
    outputs, loss_sum, loss_count = _RowBuffers(B, target), 0.0, 0
    starts = range(0, B, batch_size)
    bar = tqdm(total=len(starts), desc="run_with_cache", unit="batch", disable=not progress or len(starts) < 2)
    writer = None
    try:
        writer = ShardWriter(cache_dir, model) if cache_dir is not None else None
        activations = None if writer is not None else _RowBuffers(B, target)
        with torch.no_grad(), caching(model.hook_dict, is_cached, chunk_cache, pos_slice=pos_slice,
                                      clear_contexts=clear_contexts):
            for start in starts:
                rows_here = slice(start, min(start + batch_size, B))
                mask = None if mask_BP is None else mask_BP[rows_here]
                out = model(rows[rows_here], "logits" if return_type is not None else None, attention_mask=mask,
                            start_at_layer=start_at_layer, stop_at_layer=stop_at_layer,
                            **({} if start_at_layer is None else {"tokens": _part(targets_BP, rows_here)}),
                            **forward_kwargs)
                acts = dict(chunk_cache)
                chunk_cache.clear()
                n = rows_here.stop - start
                _check_batch_first({name: tuple(t.shape) for name, t in acts.items()}, n)
                row_outputs, (scored_sum, scored_count) = _row_outputs(out, return_type, loss_per_token,
                                                                       stop_at_layer, _part(targets_BP, rows_here), mask)
                loss_sum, loss_count = loss_sum + scored_sum, loss_count + scored_count
                if start == 0:
                    _check_fits(acts, row_outputs, n, B, target, writer)
                if writer is not None:
                    writer.write(start, rows_here.stop, acts)
                else:
                    activations.put(start, rows_here.stop, acts)
                outputs.put(start, rows_here.stop, row_outputs)
                del acts, out, row_outputs
                bar.update()
        if return_type in ("loss", "both") and stop_at_layer is None and not loss_per_token and loss_count == 0:
            raise InputError("the attention mask leaves no pair of consecutive real tokens to score")
        if writer is not None:
            writer.finish(B)
            cache = load_cache(writer.directory, model, target)
        else:
            cache = ActivationCache(activations.tensors, model, has_batch_dim=True)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        bar.close()
    return _final_output(outputs.tensors, return_type, loss_per_token, stop_at_layer, loss_sum, loss_count,
                         target), cache


# ---- helpers -------------------------------------------------------------------------------------------
class _RowBuffers:
    """Tensors for all B rows, each allocated on ``device`` when its first rows arrive, filled in place."""

    def __init__(self, rows: int, device: torch.device):
        self.rows, self.device, self.tensors = rows, device, {}

    def put(self, start: int, stop: int, parts: dict[str, Tensor]) -> None:
        for name, part in parts.items():
            if name not in self.tensors:
                self.tensors[name] = torch.empty((self.rows, *part.shape[1:]), dtype=part.dtype, device=self.device)
            self.tensors[name][start:stop].copy_(part)


def _split_inputs(model: DecoderHost, input: Any, attention_mask: Optional[Tensor], padding_side: str,
                  prepend_bos: Optional[bool], tokens: Optional[Tensor], start_at_layer: Optional[int]
                  ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(what the model runs on, split by rows: ids [B, P] or a residual stream [B, P, D]; the bool
    attention mask [B, P] or None; the ids the loss predicts [B, P] or None)."""
    if start_at_layer is None:
        tokens_BP, mask_BP = model.as_tokens_and_mask(input, prepend_bos, 0, attention_mask, padding_side)
        return tokens_BP, mask_BP, tokens_BP
    if not (isinstance(input, Tensor) and input.ndim == 3):
        raise InputError("with start_at_layer the input is the residual stream [batch, pos, d_model], got "
                         + (f"shape {tuple(input.shape)}" if isinstance(input, Tensor) else type(input).__name__))
    B, P = input.shape[:2]
    mask_BP = None if attention_mask is None else check_attention_mask(attention_mask, (B, P), input.device)
    targets_BP = None if tokens is None else model.as_tokens(tokens)
    if targets_BP is not None and tuple(targets_BP.shape) != (B, P):
        raise InputError(f"tokens= has shape {tuple(targets_BP.shape)} but the residual stream has {B} rows of {P} "
                         "positions; they must match")
    return input, mask_BP, targets_BP


def _part(tensor: Optional[Tensor], rows: slice) -> Optional[Tensor]:
    return None if tensor is None else tensor[rows]


def _check_batch_first(shapes: dict[str, tuple[int, ...]], rows: int) -> None:
    """``InputError`` naming each hook whose first axis is not the batch (``rows`` long)."""
    wrong = [f"{name} {list(shape)}" for name, shape in shapes.items() if not shape or shape[0] != rows]
    if wrong:
        raise InputError(f"these hooks' activations do not have the batch ({rows} rows) as their first axis, so "
                         f"they cannot be cached in batches: {', '.join(wrong)}")


def _row_outputs(out: Any, return_type: Optional[str], loss_per_token: bool, stop_at_layer: Optional[int],
                 targets_BP: Optional[Tensor], mask_BP: Optional[Tensor]
                 ) -> tuple[dict[str, Tensor], tuple[float, int]]:
    """One batch's outputs to join by rows, and (sum, count) of its scored next-token losses."""
    if stop_at_layer is not None:
        return {"resid": out}, (0.0, 0)
    if return_type is None:
        return {}, (0.0, 0)
    parts = {"logits": out} if return_type in ("logits", "both") else {}
    if return_type == "logits":
        return parts, (0.0, 0)
    # As next_token_loss with a mask: only pairs of two real tokens count; the others are 0 per token.
    losses_BP = next_token_loss(out, targets_BP, per_token=True)
    counted_BP = (torch.ones_like(losses_BP, dtype=torch.bool) if mask_BP is None
                  else (mask_BP[:, :-1] & mask_BP[:, 1:]).to(losses_BP.device))
    losses_BP = losses_BP.masked_fill(~counted_BP, 0.0)
    if loss_per_token:
        parts["loss"] = losses_BP
    return parts, (float(losses_BP.double().sum()), int(counted_BP.sum()))


def _final_output(outputs: dict[str, Tensor], return_type: Optional[str], loss_per_token: bool,
                  stop_at_layer: Optional[int], loss_sum: float, loss_count: int, device: torch.device) -> Any:
    """What the model's forward would have returned for all the rows at once."""
    if stop_at_layer is not None:
        return outputs["resid"]
    if return_type is None:
        return None
    if return_type == "logits":
        return outputs["logits"]
    loss = outputs["loss"] if loss_per_token else torch.tensor(loss_sum / loss_count, device=device)
    return loss if return_type == "loss" else (outputs["logits"], loss)


def _nbytes_per_row(parts: dict[str, Tensor], rows: int) -> int:
    return sum(t.numel() * t.element_size() for t in parts.values()) // rows


def _check_fits(acts: dict[str, Tensor], row_outputs: dict[str, Tensor], rows: int, B: int, device: torch.device,
                writer: Optional[ShardWriter]) -> None:
    """``CacheTooLargeError`` when what the run would hold on ``device`` (activations unless they go to
    disk, and the joined outputs), projected from its first ``rows`` rows to all B, exceeds what is
    free there, or when the shards would not fit on the disk."""
    cache_bytes = _nbytes_per_row(acts, rows) * B
    output_bytes = _nbytes_per_row(row_outputs, rows) * B
    if writer is not None:
        free = available_disk(writer.directory)
        if cache_bytes > free:
            raise CacheTooLargeError(
                f"the activations of these {B} rows take {_bytes(cache_bytes)} on disk but "
                f"{str(writer.directory)!r} has {_bytes(free)} free: choose a cache_dir on a "
                "larger disk or a names_filter that keeps fewer hooks")
    requested = output_bytes + (0 if writer is not None else cache_bytes)
    available = available_memory(device)
    if available is None or requested <= available:
        return
    held = (f"{output_bytes:,} bytes of outputs" if writer is not None
            else f"{cache_bytes:,} bytes of activations and {output_bytes:,} bytes of outputs")
    raise CacheTooLargeError(
        f"run_with_cache over these {B} rows would hold {_bytes(requested)} ({held}) on "
        f"{device} but only {_bytes(available)} are available: pass cache_dir= to stream "
        "the activations to disk, a names_filter that keeps fewer hooks"
        + (", or return_type=None / 'loss' to drop the logits" if "logits" in row_outputs else ""))


def _bytes(n: int) -> str:
    """``n`` bytes in words: "1,461,456 bytes (1.4 MiB)"."""
    return f"{n:,} bytes" + (f" ({readable_bytes(n)})" if n >= 1024 else "")
