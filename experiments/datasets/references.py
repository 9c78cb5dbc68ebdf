"""The references mean and resample ablation replace activations with: the mean activation at each position
over a dataset (computed one batch at a time, so the whole dataset's cache is never held), and a seeded draw of rows.

Legend: B batch, P position.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from jaxtyping import Int
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from workbench.errors import InputError


@torch.no_grad()
def mean_activations(model, tokens_BP: Int[Tensor, "batch pos"], hook_names: Union[str, Sequence[str]],
                     batch_size: int = 8, progress: ProgressArg = False,
                     attention_mask: Optional[Int[Tensor, "batch pos"]] = None) -> dict[str, Tensor]:
    """The mean over rows of each hook point's activation at each position, [1, pos, ...].

    The shape a mean ablation writes: a batch of one that broadcasts over any batch
    (``blocks.{l}.attn.hook_pattern`` gives [1, n_heads, pos, key_pos]). Computed streaming: the
    model runs ``batch_size`` rows at a time and hooks add each batch's sum into a float64
    running sum, so memory holds one batch's activations and the sums, never the whole cache.
    With ``attention_mask`` (1 real, 0 pad) a row counts at a position only where that position
    is real in it; a position no row has real is zeros. Results come back on the model's device
    in the dtype the hook point carries (the model's dtype). ``progress`` counts batches.

    Example:
        >>> means = mean_activations(model, torch.cat([tokens, tokens]), ["blocks.1.attn.hook_z"], batch_size=1)
        >>> means["blocks.1.attn.hook_z"].shape          # [1, pos, n_heads, d_head]
        torch.Size([1, 14, 4, 32])
        >>> torch.allclose(means["blocks.1.attn.hook_z"], cache["blocks.1.attn.hook_z"], atol=1e-4)   # one prompt twice: itself
        True
    """
    names = [hook_names] if isinstance(hook_names, str) else list(hook_names)
    if not names:
        raise InputError("hook_names is empty: name at least one hook point")
    model.check_hook_names(names)
    if batch_size < 1:
        raise InputError(f"batch_size must be at least 1, got {batch_size}")
    tokens_BP, given_mask_BP = model.as_tokens_and_mask(tokens_BP, attention_mask=attention_mask)
    B, P = tokens_BP.shape
    # Without a mask every row counts everywhere; the model then runs unmasked (its fastest path).
    mask_BP = given_mask_BP if given_mask_BP is not None else torch.ones(B, P, dtype=torch.bool,
                                                                         device=tokens_BP.device)

    sums: dict[str, Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    current: dict[str, Tensor] = {}  # the running batch's mask, read by the hooks

    def accumulate(activation: Tensor, hook) -> None:
        if not activation.is_floating_point():
            raise InputError(f"{hook.name} carries {activation.dtype} values (ids, not activations); it has no mean")
        keep = _broadcast_over(current["mask"], hook.name, activation.ndim)
        # where, not multiply: attention scores hold -inf, and -inf * 0 would be nan.
        batch_sum = torch.where(keep, activation, 0).sum(0, keepdim=True, dtype=_sum_dtype(activation))
        sums[hook.name] = batch_sum if hook.name not in sums else sums[hook.name] + batch_sum
        dtypes[hook.name] = activation.dtype

    with Progress(progress, total=-(-B // batch_size), desc="mean activations") as bar, \
            model.hooks(fwd_hooks=[(name, accumulate) for name in names]):
        for start in range(0, B, batch_size):
            rows = slice(start, start + batch_size)
            current["mask"] = mask_BP[rows]
            model(tokens_BP[rows], return_type=None,
                  attention_mask=None if given_mask_BP is None else given_mask_BP[rows])
            bar.advance()

    silent = [name for name in names if name not in sums]
    if silent:
        raise InputError(f"hook point(s) {silent} did not fire in a forward pass (a hook point the model "
                         "computes only when switched on, e.g. hook_q_input needs set_use_split_qkv_input(True))")
    count_P = mask_BP.sum(0)  # real rows at each position
    means = {}
    for name in names:
        count = _broadcast_over(count_P[None], name, sums[name].ndim).to(sums[name].dtype)
        mean = torch.where(count > 0, sums[name] / count.clamp(min=1), 0)
        means[name] = mean.to(device=model.cfg.device, dtype=dtypes[name])
    return means


def _position_axis(hook_name: str) -> int:
    """Where the (query) position axis is: attention scores and patterns are [batch, n_heads, pos, key_pos]."""
    return 2 if hook_name.endswith(("hook_pattern", "hook_attn_scores")) else 1


def _broadcast_over(values_BP: Tensor, hook_name: str, ndim: int) -> Tensor:
    """A [batch, pos] tensor shaped to broadcast against an activation of ``ndim`` axes at ``hook_name``."""
    axis = _position_axis(hook_name)
    shape = [values_BP.shape[0]] + [1] * (ndim - 1)
    shape[axis] = values_BP.shape[1]
    return values_BP.reshape(shape)


def _sum_dtype(activation: Tensor) -> torch.dtype:
    """float64 for the running sums (exact enough over any dataset), float32 where the device has no float64."""
    return torch.float32 if activation.device.type == "mps" else torch.float64


def resample_reference(tokens_BP: Int[Tensor, "batch pos"], n: int, seed: int = 0) -> Int[Tensor, "n_rows pos"]:
    """``n`` rows drawn from ``tokens_BP`` (without replacement when n <= rows, with it otherwise),
    the same rows for the same seed: the reference batch of a resample ablation.

    Example:
        >>> resample_reference(torch.arange(12).reshape(4, 3), 2, seed=0).shape
        torch.Size([2, 3])
    """
    if not isinstance(tokens_BP, Tensor) or tokens_BP.ndim != 2 or tokens_BP.shape[0] < 1:
        shape = tuple(tokens_BP.shape) if isinstance(tokens_BP, Tensor) else type(tokens_BP).__name__
        raise InputError(f"resample_reference takes token ids [batch, pos] with at least one row, got {shape}")
    if not isinstance(n, int) or n < 1:
        raise InputError(f"n must be a positive number of rows, got {n!r}")
    rows = tokens_BP.shape[0]
    generator = torch.Generator().manual_seed(seed)
    if n <= rows:
        index = torch.randperm(rows, generator=generator)[:n]
    else:
        index = torch.randint(rows, (n,), generator=generator)
    return tokens_BP[index.to(tokens_BP.device)]
