"""Token ids as labels: each token's text, position-prefixed axis labels, and per-token values as floats.

Experiments take text or ids (``workbench.tokens_api.TextOrTokens``, the one tokens type) and turn them into
checked [batch, pos] ids with the model's own ``Decoder.as_tokens``.
"""

from __future__ import annotations

import html

from jaxtyping import Int
from torch import Tensor


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


def chart_text(text: str) -> str:
    """``text`` as plotly shows it literally: plotly renders tags (``<a href>``, ``<b>``) in labels, titles and
    hovers, so a token or prompt holding markup is escaped (plotly decodes ``&lt;`` ``&gt;`` ``&amp;``).

    Example:
        >>> chart_text('<a href="https://x.example">x</a> & y')
        '&lt;a href="https://x.example"&gt;x&lt;/a&gt; &amp; y'
    """
    return html.escape(str(text), quote=False)


def token_label(token: str, limit: int = 40) -> str:
    """A token as a chart shows it: quoted (so " " and "\\n" are visible), cut to ``limit`` characters, escaped
    (``chart_text``).

    Example:
        >>> token_label(" cat"), token_label("<b>"), token_label("x" * 50, limit=8)
        ("' cat'", "'&lt;b&gt;'", "'xxxxxxx")
    """
    return chart_text(repr(token)[:limit])


def axis_labels(str_toks: list[str]) -> list[str]:
    """Position-prefixed labels ("3: 'the'"): plotly merges repeated category labels, positions keep them apart.
    Tokens are escaped for plotly (``chart_text``).

    Example:
        >>> axis_labels(["The", " cat", "The", "<i>"])
        ["0: 'The'", "1: ' cat'", "2: 'The'", "3: '&lt;i&gt;'"]
    """
    return [chart_text(f"{i}: {tok!r}"[:40]) for i, tok in enumerate(str_toks)]


def as_floats(values) -> list[float]:
    """A tensor, array or sequence of numbers (one per token) as a list of floats.

    Example:
        >>> as_floats(torch.tensor([0.5, 1.0])), as_floats([1, 2])
        ([0.5, 1.0], [1.0, 2.0])
    """
    if isinstance(values, Tensor):
        values = values.detach().float().cpu().tolist()
    return [float(v) for v in values]
