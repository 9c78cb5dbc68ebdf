"""Repeated random tokens, the induction experiments' input: a prefix token, then the same random tokens twice.

Legend: B batch, P position, C copy length.
"""

from __future__ import annotations

import torch
from jaxtyping import Int
from torch import Tensor

from workbench.errors import InputError


def prefix_token(model) -> int:
    """BOS when the model's tokenizer has one, else token 0.

    Example:
        >>> prefix_token(model), model.tokenizer.bos_token_id     # toy-attn-2l's BOS is id 0
        (0, 0)
    """
    bos = model.tokenizer.bos_token_id if model.tokenizer is not None else None
    return int(bos) if bos is not None else 0


def repeated_random_tokens(model, seq_len: int = 50, batch: int = 10, seed: int = 0) -> Int[Tensor, "batch pos"]:
    """[batch, 1 + 2*seq_len] ids: a prefix token, then seq_len random tokens twice.

    Tokens are drawn without replacement within a copy (and never equal the prefix), from a
    generator seeded with ``seed``, so the result depends only on (d_vocab, prefix, seq_len, batch, seed).

    Example:
        >>> repeated = repeated_random_tokens(model, seq_len=5, batch=2)
        >>> repeated.shape, torch.equal(repeated[:, 1:6], repeated[:, 6:])
        (torch.Size([2, 11]), True)
    """
    d_vocab, prefix = model.cfg.d_vocab, prefix_token(model)
    if seq_len < 1 or batch < 1:
        raise InputError(f"seq_len and batch must be positive, got seq_len={seq_len}, batch={batch}")
    if seq_len > d_vocab - 1:
        raise InputError(f"seq_len={seq_len} distinct tokens do not fit a vocabulary of {d_vocab} (prefix excluded)")
    if 1 + 2 * seq_len > model.cfg.n_ctx:
        raise InputError(f"1 + 2*seq_len = {1 + 2 * seq_len} positions exceed the model's context (n_ctx={model.cfg.n_ctx})")
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        draw = torch.randperm(d_vocab - 1, generator=generator)[:seq_len]
        rows.append(draw + (draw >= prefix).long())  # skip the prefix id
    copy_BC = torch.stack(rows)
    tokens = torch.cat([torch.full((batch, 1), prefix, dtype=torch.long), copy_BC, copy_BC], dim=1)
    return tokens.to(model.cfg.device)

