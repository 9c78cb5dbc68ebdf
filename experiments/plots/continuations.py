"""A continuation (``experiments.continuations``) as HTML text: the tokens from the first divergence on highlighted."""

from __future__ import annotations

import html
from typing import Optional, Sequence


def highlighted_html(tokens: Sequence[str], start: Optional[int], color: str = "#fde68a") -> str:
    """The tokens as HTML text, those from index ``start`` on (None: none) on a ``color`` background.

    Token texts are escaped; each token is a ``span`` whose title is its index, so a hover tells
    the step.

    Example:
        >>> highlighted_html(["a", " <b>"], 1)
        '<span title="step 0">a</span><span title="step 1" style="background:#fde68a"> &lt;b&gt;</span>'
    """
    spans = []
    for i, token in enumerate(tokens):
        style = f' style="background:{color}"' if start is not None and i >= start else ""
        spans.append(f'<span title="step {i}"{style}>{html.escape(token)}</span>')
    return "".join(spans)
