"""HTML of ``experiments.neurons``: a neuron's top corpus windows as text with the max token highlighted."""

from __future__ import annotations

import math

import pandas as pd

from experiments._tokens import str_tokens
from experiments.neurons import CorpusMaxima
from experiments.plots.token_view import token_html


def top_windows_html(model, maxima: CorpusMaxima, table: pd.DataFrame) -> str:
    """Each window of a ``top_windows`` table as text with its max token highlighted (one line each).

    Example:
        >>> from experiments.neurons import MLPUnit, corpus_maxima, top_windows
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)
        >>> maxima = corpus_maxima(moe_model, MLPUnit(1, expert=3), n_windows=16, window=32, use_disk=False)
        >>> html = top_windows_html(moe_model, maxima, top_windows(moe_model, maxima, 17, k=3))
        >>> html.count('class="wb-token-view"'), "#1 · window" in html
        (3, True)
    """
    parts = []
    for row in table.itertuples():
        window_tokens = str_tokens(model, maxima.windows_BP[row.window])
        values = [math.nan] * len(window_tokens)
        values[row.position] = row.max_activation
        caption = f"#{row.rank} · window {row.window} · max {row.max_activation:.4g} at position {row.position}"
        parts.append(token_html(window_tokens, values, selected=row.position, value_name="activation",
                                line_breaks=False, caption=caption))
    return "\n".join(parts)
