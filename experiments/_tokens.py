"""Token ids as labels: each token's text, and position-prefixed axis labels.

Experiments take text or ids (``TokensLike``) and turn them into checked [batch, pos] ids with
the model's own ``Decoder.as_tokens``.
"""

from __future__ import annotations

from typing import Union

from jaxtyping import Int
from torch import Tensor

TokensLike = Union[str, list[str], Int[Tensor, "batch pos"], Int[Tensor, "pos"]]


def str_tokens(model, tokens_P: Int[Tensor, "pos"]) -> list[str]:
    """Each token as text (its id in angle brackets when the model has no tokenizer).

    Example:
        >>> str_tokens(model_without_tokenizer, torch.tensor([3, 4]))   # doctest: +SKIP
        ['<3>', '<4>']
    """
    ids = tokens_P.tolist()
    if model.tokenizer is None:
        return [f"<{i}>" for i in ids]
    return model.to_str_tokens(ids)


def axis_labels(str_toks: list[str]) -> list[str]:
    """Position-prefixed labels ("3: the"): plotly merges repeated category labels, positions keep them apart."""
    return [f"{i}: {tok!r}"[:40] for i, tok in enumerate(str_toks)]
