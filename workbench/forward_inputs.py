"""What ``Decoder.forward`` checks and derives from its arguments before the first block runs.

- ``check_layer_range``: ``start_at_layer`` / ``stop_at_layer`` are layer indices of the model (negatives count
  from the end, as in TransformerLens), and a run that starts at a layer is given a residual stream;
- ``positions_and_key_mask``: each token's position and the key mask over every position so far (padding, a
  KV cache's earlier positions).
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import torch
from torch import Tensor

from workbench.errors import InputError
from workbench.generation import KVCache


def check_layer_range(input: Any, start_at_layer: Optional[int], stop_at_layer: Optional[int], n_layers: int,
                      d_model: int) -> None:
    """Raises ``InputError`` naming the argument when a layer index is not an integer in ``-n_layers..n_layers``,
    or ``start_at_layer`` is given something other than a residual stream ``[batch, pos, d_model]``.

    Example:
        >>> check_layer_range(torch.zeros(1, 2, 4), 1, None, n_layers=2, d_model=4)
        >>> check_layer_range(None, None, 3, n_layers=2, d_model=4)
        Traceback (most recent call last):
        workbench.errors.InputError: stop_at_layer=3 is outside -2..2 for a model of 2 layers
    """
    L = n_layers
    for name, value in (("start_at_layer", start_at_layer), ("stop_at_layer", stop_at_layer)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise InputError(f"{name} must be an integer layer index or None, got {value!r}")
        if value is not None and not -L <= value <= L:
            raise InputError(f"{name}={value} is outside -{L}..{L} for a model of {L} layers")
    if start_at_layer is not None and not (isinstance(input, Tensor) and input.is_floating_point()
                                           and input.ndim == 3 and input.shape[-1] == d_model):
        got = (f"a {input.dtype} tensor of shape {tuple(input.shape)}" if isinstance(input, Tensor)
               else f"a {type(input).__name__}")
        raise InputError(f"start_at_layer takes the residual stream [batch, pos, d_model={d_model}] "
                         f"entering that layer as input, got {got} (token ids or text run from the start: "
                         "leave start_at_layer out)")


def positions_and_key_mask(mask_BP: Optional[Tensor], kv_cache: Optional[KVCache], B: int, P: int,
                           device: torch.device) -> tuple[Optional[Tensor], Tensor]:
    """(key mask [B, S] over every position so far, or None when nothing is padding; positions
    [P], or [B, P] counted from each row's first real token). Keeps the KV cache's mask current.

    Example:
        >>> key_mask, positions = positions_and_key_mask(torch.tensor([[0, 1, 1]]).bool(), None, 1, 3, "cpu")
        >>> key_mask.tolist(), positions.tolist()
        ([[False, True, True]], [[0, 0, 1]])
    """
    offset = kv_cache.length if kv_cache is not None else 0
    prior_BS = kv_cache.mask_BS if kv_cache is not None else None
    if prior_BS is None and (mask_BP is None or bool(mask_BP.all())):
        return None, torch.arange(offset, offset + P, device=device)
    new_BP = mask_BP if mask_BP is not None else torch.ones(B, P, dtype=torch.bool, device=device)
    if prior_BS is None:
        prior_BS = torch.ones(B, offset, dtype=torch.bool, device=device)
    key_mask_BS = torch.cat([prior_BS.to(device), new_BP], dim=1)
    if offset == 0:  # later calls extend rows that already hold a real token
        padding_rows = (~key_mask_BS.any(dim=1)).nonzero().flatten().tolist()
        if padding_rows:
            raise InputError(f"row(s) {padding_rows} of attention_mask are all padding: nothing to run")
    if kv_cache is not None:
        kv_cache.mask_BS = key_mask_BS
    return key_mask_BS, (key_mask_BS.long().cumsum(dim=1) - 1).clamp(min=0)[:, -P:]
