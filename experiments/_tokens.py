"""Token ids as labels: each token's text, position-prefixed axis labels, and per-token values as floats.

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
        >>> str_tokens(model, tokens[0, :3])
        ['<|endoftext|>', 'The', ' c']
        >>> model.tokenizer = None   # this example's own copy of the model
        >>> str_tokens(model, torch.tensor([3, 4]))
        ['<3>', '<4>']
    """
    ids = tokens_P.tolist()
    if model.tokenizer is None:
        return [f"<{i}>" for i in ids]
    return model.to_str_tokens(ids)


def axis_labels(str_toks: list[str]) -> list[str]:
    """Position-prefixed labels ("3: 'the'"): plotly merges repeated category labels, positions keep them apart.

    Example:
        >>> axis_labels(["The", " cat", "The"])
        ["0: 'The'", "1: ' cat'", "2: 'The'"]
    """
    return [f"{i}: {tok!r}"[:40] for i, tok in enumerate(str_toks)]


def as_floats(values) -> list[float]:
    """A tensor, array or sequence of numbers (one per token) as a list of floats.

    Example:
        >>> as_floats(torch.tensor([0.5, 1.0])), as_floats([1, 2])
        ([0.5, 1.0], [1.0, 2.0])
    """
    if isinstance(values, Tensor):
        values = values.detach().float().cpu().tolist()
    return [float(v) for v in values]
