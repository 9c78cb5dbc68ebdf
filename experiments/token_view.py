"""The prompt as coloured text, CircuitsVis-style: every token's background shows a value (the attention
it gets from or pays to a selected token, a neuron's activation, an ablation's loss change).

Legend: L n_layers, H n_heads, P position, S key position.

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
from typing import Literal, Optional, Sequence

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from workbench.errors import InputError

Direction = Literal["from_selected", "to_selected"]
DIRECTIONS: tuple[str, ...] = ("from_selected", "to_selected")
POSITIVE_RGB, NEGATIVE_RGB = (214, 39, 40), (31, 119, 180)
_SHOWN = {"\n": "↵", "\t": "⇥", "\r": "␍"}


def selected_attention(patterns_LHPS: Float[Tensor, "n_layers n_heads pos key_pos"], layer: int, head: Optional[int],
                       token: int, direction: Direction = "from_selected") -> Float[Tensor, "pos"]:
    """The attention between the selected ``token`` and every position, for one head or (``head=None``)
    the mean over the layer's heads.

    ``"from_selected"``: what the selected token pays to each position (its row of the pattern: query
    ``token``, each key). ``"to_selected"``: what each position pays to the selected token (its column:
    each query, key ``token``). Positions the causal mask hides get 0.

    Example:
        >>> patterns_LHPS = torch.tensor([[[[1.0, 0.0], [0.25, 0.75]]]])
        >>> selected_attention(patterns_LHPS, 0, 0, 1).tolist(), selected_attention(patterns_LHPS, 0, 0, 0, "to_selected").tolist()
        ([0.25, 0.75], [1.0, 0.25])
    """
    n_layers, n_heads, n_pos = patterns_LHPS.shape[0], patterns_LHPS.shape[1], patterns_LHPS.shape[2]
    if not 0 <= layer < n_layers:
        raise InputError(f"layer must be in 0..{n_layers - 1}, got {layer}")
    if head is not None and not 0 <= head < n_heads:
        raise InputError(f"head must be in 0..{n_heads - 1} (or None for the mean over heads), got {head}")
    if not 0 <= token < n_pos:
        raise InputError(f"the selected token must be a position in 0..{n_pos - 1}, got {token}")
    if direction not in DIRECTIONS:
        raise InputError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    pattern_HPS = patterns_LHPS[layer] if head is None else patterns_LHPS[layer, head:head + 1]
    values_HP = pattern_HPS[:, token, :] if direction == "from_selected" else pattern_HPS[:, :, token]
    return values_HP.float().mean(0)


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


def _as_floats(values) -> list[float]:
    if isinstance(values, Tensor):
        values = values.detach().float().cpu().tolist()
    return [float(v) for v in values]


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
    floats = _as_floats(values)
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


def token_values(str_tokens: Sequence[str], values, value_name: str = "value") -> pd.DataFrame:
    """The values beside their tokens, for a CSV: DataFrame[position, token, <value_name>].

    Example:
        >>> token_values(["a", "b"], [0.5, 1.0], "attention").columns.tolist()
        ['position', 'token', 'attention']
    """
    floats = _as_floats(values)
    if len(floats) != len(str_tokens):
        raise InputError(f"token_values got {len(str_tokens)} tokens but {len(floats)} values")
    return pd.DataFrame({"position": range(len(floats)), "token": list(str_tokens), value_name: floats})


def per_position(df: pd.DataFrame, column: str, n_positions: int) -> list[float]:
    """A table with a ``position`` column as one value per position (NaN where it has no row), e.g. the
    per-token loss change of ``experiments.ablation.per_token_loss_change`` (no row for position 0).

    Example:
        >>> per_position(pd.DataFrame({"position": [1, 2], "delta": [0.5, -1.0]}), "delta", 3)
        [nan, 0.5, -1.0]
    """
    values = [math.nan] * n_positions
    for position, value in zip(df["position"], df[column]):
        values[int(position)] = float(value)
    return values


def html_document(fragment: str, title: str) -> str:
    """A standalone HTML page around a fragment (for a download).

    Example:
        >>> html_document("<p>x</p>", "Token view").startswith("<!DOCTYPE html>")
        True
    """
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title></head>'
            f'<body style="font-family: sans-serif; margin: 16px;">\n{fragment}\n</body></html>\n')
