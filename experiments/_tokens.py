"""Turning what a caller passes (text, [pos] or [batch, pos] ids) into [batch, pos] ids, and ids into labels."""

from __future__ import annotations

from typing import Union

import torch
from jaxtyping import Int
from torch import Tensor

from workbench.errors import InputError

TokensLike = Union[str, list[str], Int[Tensor, "batch pos"], Int[Tensor, "pos"]]


def as_batch(model, tokens: TokensLike) -> Int[Tensor, "batch pos"]:
    """Token ids as [batch, pos] on the model's device; text is tokenized with the model's tokenizer.

    Example:
        >>> as_batch(model, torch.tensor([5, 6, 7])).shape   # doctest: +SKIP
        torch.Size([1, 3])
    """
    if isinstance(tokens, (str, list)):
        tokens = model.to_tokens(tokens)
    if not isinstance(tokens, Tensor):
        raise InputError(f"expected text or a tensor of token ids, got {type(tokens).__name__}")
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise InputError(f"token ids must be an integer tensor, got dtype {tokens.dtype}")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.numel() == 0:
        raise InputError(f"token ids must be a non-empty [batch, pos] or [pos] tensor, got shape {tuple(tokens.shape)}")
    return tokens.to(model.embed.W_E.device)


def str_tokens(model, tokens_P: Int[Tensor, "pos"]) -> list[str]:
    """Each token as text (its id in angle brackets when the model has no tokenizer).

    Example:
        >>> str_tokens(model_without_tokenizer, torch.tensor([3, 4]))   # doctest: +SKIP
        ['<3>', '<4>']
    """
    ids = tokens_P.tolist()
    if getattr(model, "tokenizer", None) is None:
        return [f"<{i}>" for i in ids]
    return model.to_str_tokens(torch.tensor(ids))


def axis_labels(str_toks: list[str]) -> list[str]:
    """Position-prefixed labels ("3: the"): plotly merges repeated category labels, positions keep them apart."""
    return [f"{i}: {tok!r}"[:40] for i, tok in enumerate(str_toks)]
