"""The prompt as coloured text, CircuitsVis-style: every token's background shows a value (the attention
it gets from or pays to a selected token, a neuron's activation, an ablation's loss change;
``experiments.token_view`` computes them).

``token_html`` returns a self-contained HTML fragment (inline styles only, so it survives sanitisers such
as Streamlit's ``st.html``): one ``<span>`` per token carrying ``data-pos`` and ``data-value`` (the
value, 6 significant digits) and a ``title`` for the hover. Token text is escaped with ``html.escape``;
whitespace is made visible (a space-only token as ␣, a newline as ↵, a tab as ⇥).

Colour: red for positive values, blue for negative, with opacity |value| / vmax (vmax: the largest
|value| unless given), rounded to 3 decimals; NaN (no value: e.g. an expert that did not run) is grey text.
"""

from __future__ import annotations

import html
import math
from typing import Optional, Sequence

from experiments._tokens import as_floats
from workbench.errors import InputError

POSITIVE_RGB, NEGATIVE_RGB = (214, 39, 40), (31, 119, 180)
_SHOWN = {"\n": "↵", "\t": "⇥", "\r": "␍"}


def visible_token(text: str) -> str:
    """Token text with whitespace made visible (not yet escaped).

    Example:
        >>> visible_token(" "), visible_token("\\n"), visible_token(" cat"), visible_token("")
        ('␣', '↵', ' cat', '∅')
    """
    if text == "":
        return "∅"
    shown = text.replace(" ", "␣") if not text.strip() else text
    for raw, symbol in _SHOWN.items():
        shown = shown.replace(raw, symbol)
    return shown


def _colour(value: float, vmax: float) -> tuple[str, float]:
    """The background (CSS rgba) and its opacity for ``value`` on a scale of ±``vmax``."""
    if math.isnan(value):
        return "transparent", 0.0
    alpha = round(min(1.0, abs(value) / vmax), 3) if vmax > 0 else 0.0
    r, g, b = POSITIVE_RGB if value >= 0 else NEGATIVE_RGB
    return f"rgba({r}, {g}, {b}, {alpha})", alpha


def token_html(str_tokens: Sequence[str], values, selected: Optional[int] = None, value_name: str = "value",
               vmax: Optional[float] = None, line_breaks: bool = True, caption: Optional[str] = None) -> str:
    """The tokens as one HTML fragment, each coloured by its value (see the module docstring).

    ``selected``: a position drawn with an outline. ``line_breaks``: a newline token also breaks the
    line (the prompt as it reads); off, the text stays on one wrapped line. ``caption``: a line above.

    Example:
        >>> fragment = token_html(["<b>", " cat"], [0.5, 1.0], selected=1)
        >>> "&lt;b&gt;" in fragment and 'data-value="0.5"' in fragment and "rgba(214, 39, 40, 0.5)" in fragment
        True
    """
    floats = as_floats(values)
    if len(floats) != len(str_tokens):
        raise InputError(f"token_html got {len(str_tokens)} tokens but {len(floats)} values")
    finite = [abs(v) for v in floats if not math.isnan(v)]
    scale = vmax if vmax is not None else (max(finite) if finite else 0.0)
    spans = []
    for position, (text, value) in enumerate(zip(str_tokens, floats)):
        background, alpha = _colour(value, scale)
        style = f"background-color: {background}; padding: 1px 0; border-radius: 2px;"
        style += " color: #999;" if math.isnan(value) else (" color: #fff;" if alpha > 0.6 else " color: #111;")
        if position == selected:
            style += " outline: 2px solid #111; outline-offset: -1px;"
        shown = f"{value:.4g}" if not math.isnan(value) else "none"
        title = f"{position}: {text!r} · {value_name} {shown}"
        spans.append(f'<span class="wb-token" data-pos="{position}" data-value="{value:.6g}" '
                     f'title="{html.escape(title, quote=True)}" style="{style}">{html.escape(visible_token(text))}</span>'
                     + ("<br>" * text.count("\n") if line_breaks else ""))
    head = f'<div style="font-size: 12px; color: #555;">{html.escape(caption)}</div>' if caption else ""
    scale_note = (f'<div style="font-size: 11px; color: #777;">{html.escape(value_name)}: full colour at '
                  f'±{scale:.4g}</div>')
    return (f'<div class="wb-token-view" style="margin: 4px 0 10px 0;">{head}'
            f'<div style="font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 14px; '
            f'line-height: 1.9; white-space: pre-wrap; word-break: break-word;">{"".join(spans)}</div>'
            f'{scale_note}</div>')


def html_document(fragment: str, title: str) -> str:
    """A standalone HTML page around a fragment (for a download).

    Example:
        >>> html_document("<p>x</p>", "Token view").startswith("<!DOCTYPE html>")
        True
    """
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title></head>'
            f'<body style="font-family: sans-serif; margin: 16px;">\n{fragment}\n</body></html>\n')
