"""The Attention page's defaults and its "who attends to this token" view: the layers the grid opens on (where
the last token reads other tokens' content, not BOS), and every head's attention to one key position as a
layers x heads heatmap.

Legend: P position, S key position, H n_heads, L n_layers.
"""

from __future__ import annotations

import html
from typing import Sequence

import numpy as np
import streamlit as st
import torch
from jaxtyping import Float
from torch import Tensor

from app import downloads
from app.safe_text import quoted
from app.url_state import follow, linked
from experiments.plots.common import scores_heatmap

FROM_LAST, FROM_LATER = "the last token", "every token at or after it (mean)"


def content_reads_L(patterns_LHPS: Float[Tensor, "L H P S"], special: Sequence[int]) -> Float[Tensor, "L"]:
    """Each layer's strongest read of content by the last token: over its heads, the largest attention from the
    last query to a key that is neither special (BOS, pad) nor the last token itself nor the one before it (what
    a previous-token head reads). The heads that answer a prompt read the tokens the answer depends on.

    Example:
        >>> patterns_LHPS = torch.zeros(2, 1, 4, 4)
        >>> patterns_LHPS[0, 0, 3] = torch.tensor([1.0, 0.0, 0.0, 0.0])   # layer 0: all on BOS
        >>> patterns_LHPS[1, 0, 3] = torch.tensor([0.2, 0.7, 0.1, 0.0])   # layer 1: reads token 1
        >>> content_reads_L(patterns_LHPS, special=(0,)).tolist()
        [0.0, 0.699999988079071]
    """
    n_keys = patterns_LHPS.shape[-1]
    left_out = {*special, n_keys - 1, n_keys - 2}
    keep = [key for key in range(n_keys) if key not in left_out]
    if not keep:
        return torch.zeros(patterns_LHPS.shape[0])
    return patterns_LHPS[:, :, -1, keep].amax(dim=(1, 2)).float()


def default_grid_layers(patterns_LHPS: Float[Tensor, "L H P S"], special: Sequence[int], width: int) -> tuple[int, int]:
    """The ``width`` consecutive layers (all when they are fewer) where the last token reads the most content
    (``content_reads_L`` summed; the earliest such window on a tie): the grid's default range for this prompt.

    Example:
        >>> patterns_LHPS = torch.zeros(4, 1, 4, 4)
        >>> patterns_LHPS[2, 0, 3, 1] = 0.9   # only layer 2 reads content
        >>> default_grid_layers(patterns_LHPS, special=(0,), width=2), default_grid_layers(patterns_LHPS, (0,), 9)
        ((1, 2), (0, 3))
    """
    n_layers = patterns_LHPS.shape[0]
    width = max(1, min(width, n_layers))
    if width == n_layers:
        return 0, n_layers - 1
    reads = content_reads_L(patterns_LHPS, special)
    sums = torch.stack([reads[first:first + width].sum() for first in range(n_layers - width + 1)])
    first = int(torch.argmax(sums))  # argmax returns the first of equal maxima
    return first, first + width - 1


def strongest_reader(patterns_LHPS: Float[Tensor, "L H P S"], special: Sequence[int]) -> tuple[int, int]:
    """The (layer, head) whose last query reads content the most (``content_reads_L``'s measure, per head): the
    head the Home page draws first. The first such head on a tie, (0, 0) when no key is left to read.

    Example:
        >>> patterns_LHPS = torch.zeros(2, 3, 4, 4)
        >>> patterns_LHPS[1, 2, 3, 1] = 0.6   # L1H2's last query reads token 1
        >>> strongest_reader(patterns_LHPS, special=(0,))
        (1, 2)
    """
    n_keys = patterns_LHPS.shape[-1]
    left_out = {*special, n_keys - 1, n_keys - 2}
    keep = [key for key in range(n_keys) if key not in left_out]
    if not keep:
        return 0, 0
    reads_LH = patterns_LHPS[:, :, -1, keep].amax(dim=-1)
    layer, head = divmod(int(torch.argmax(reads_LH)), reads_LH.shape[1])
    return layer, head


def attention_to_key_LH(patterns_LHPS: Float[Tensor, "L H P S"], key: int, from_last: bool) -> Float[Tensor, "L H"]:
    """Every head's attention to key position ``key``: from the last query (``from_last``), else the mean over
    the queries at or after ``key`` (the ones that can see it).

    Example:
        >>> patterns_LHPS = torch.rand(2, 3, 4, 4)
        >>> torch.equal(attention_to_key_LH(patterns_LHPS, 1, from_last=True), patterns_LHPS[:, :, 3, 1])
        True
        >>> torch.allclose(attention_to_key_LH(patterns_LHPS, 2, False), patterns_LHPS[:, :, 2:, 2].mean(-1))
        True
    """
    if from_last:
        return patterns_LHPS[:, :, -1, key]
    return patterns_LHPS[:, :, key:, key].mean(dim=-1)


def default_key(patterns_LHPS: Float[Tensor, "L H P S"], special: Sequence[int]) -> int:
    """The key the last token attends to most, summed over every head, special tokens and itself left out (its
    own position when nothing else is left).

    Example:
        >>> patterns_LHPS = torch.zeros(1, 2, 3, 3)
        >>> patterns_LHPS[0, :, 2] = torch.tensor([0.8, 0.15, 0.05])
        >>> default_key(patterns_LHPS, special=(0,)), default_key(patterns_LHPS, special=())
        (1, 0)
    """
    n_keys = patterns_LHPS.shape[-1]
    totals = patterns_LHPS[:, :, -1, :].sum(dim=(0, 1)).clone().float()
    totals[[*special, n_keys - 1]] = -1.0
    return int(torch.argmax(totals)) if float(totals.max()) >= 0 else n_keys - 1


def who_attends_view(patterns_LHPS: Float[Tensor, "L H P S"], str_tokens: list[str], ids: tuple[int, ...],
                     special: Sequence[int]) -> None:
    """Pick a key position, see every head's attention to it as a layers x heads heatmap (the key and the
    "from" choice are linked; the key goes back to this prompt's default when the prompt changes).

    Example:
        >>> who_attends_view(patterns_LHPS, prompt.str_tokens, prompt.ids, special=(0,))   # doctest: +SKIP
    """
    st.subheader("Who attends to this token")
    n_keys = patterns_LHPS.shape[-1]
    follow("attention_key", ids, "attention_key")
    left, right = st.columns(2)
    with left:
        key = linked(st.selectbox, "Key token", options=list(range(n_keys)), index=default_key(patterns_LHPS, special),
                     format_func=lambda p: f"{p}: {str_tokens[p]!r}", key="attention_key",
                     help="Default: the token the last token attends to most over all heads, special tokens left out.")
    with right:
        source = linked(st.radio, "Attention from", options=[FROM_LAST, FROM_LATER], key="attention_key_from",
                        horizontal=True)
    values_LH = attention_to_key_LH(patterns_LHPS, int(key), source == FROM_LAST)
    title = f"Attention to {key} {html.escape(repr(str_tokens[key])[:40], quote=False)} from {source}"
    fig = scores_heatmap(values_LH, title, value_name="attention")
    downloads.figure(fig, f"attention_to_key{key}", key="who_attends", stretch=False)
    top = np.unravel_index(int(torch.argmax(values_LH)), tuple(values_LH.shape))
    st.caption(f"Strongest: L{top[0]}H{top[1]} ({float(values_LH[top]):.3f}) attends to {quoted(repr(str_tokens[key]))}.")
