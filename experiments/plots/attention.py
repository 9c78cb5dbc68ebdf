"""Figures of attention patterns (``experiments.attention`` computes them): one head, a layer, the layer x head grid.

Legend: H n_heads, L n_layers, P position, S key position.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import plotly.graph_objects as go
from jaxtyping import Float
from torch import Tensor

from experiments._tokens import axis_labels, token_label
from experiments.plots.common import colorscale_json, distinct_labels, labelled_heatmap, to_numpy
from experiments.plots.raster import colour_png
from workbench.errors import InputError

# Past this many tokens the per-token tick labels of a layer's subplots overlap, so they are left off.
MAX_LABELLED_TOKENS = 40
KEY_LABEL_PX = 75  # room under a layer's tiles for the rotated key labels


def pattern_figure(pattern_PS: Float[Tensor, "pos key_pos"], str_tokens: Sequence[str], title: str = "") -> go.Figure:
    """One head's pattern as a heatmap: queries down, keys across, token labels on both axes.

    Example:
        >>> from experiments.attention import attention_patterns
        >>> fig = pattern_figure(attention_patterns(model, tokens)[1, 2], model.to_str_tokens(tokens), "L1H2")
        >>> fig.data[0].z.shape, fig.data[0].z.dtype, fig.data[0].x[:2]   # tokens escaped: shown as typed
        ((14, 14), dtype('float32'), ("0: '&lt;|endoftext|&gt;'", "1: 'The'"))
    """
    z = to_numpy(pattern_PS).astype(np.float32)  # 4 bytes a cell reach the browser, not 8
    if z.ndim != 2 or z.shape[0] != len(str_tokens) or z.shape[1] != len(str_tokens):
        raise InputError(f"pattern of shape {z.shape} does not match {len(str_tokens)} tokens")
    labels = axis_labels(list(str_tokens))
    fig = labelled_heatmap(z, labels, labels, title=title, x_title="key", y_title="query",
                           value_name="attention", colorscale="Blues")
    fig.update_layout(height=max(350, 18 * len(labels) + 150), width=max(450, 18 * len(labels) + 250))
    return fig


def pattern_grid_figure(
    patterns_LHPS: Float[Tensor, "n_layers n_heads pos key_pos"],
    str_tokens: Optional[Sequence[str]] = None,
    layers: Optional[Sequence[int]] = None,
    light: bool = False,
    zmax: float = 1.0,
) -> go.Figure:
    """A layer x head grid of small pattern heatmaps, drawn as one tiled heatmap (fast even for 270 heads).

    Tiles are separated by blank gaps; the hover names layer, head, query and key positions, and
    the title lists the tokens by position. The colour scale runs from 0 to ``zmax``.

    ``light=True`` makes the figure the dashboard sends to the browser: the tiles are one PNG image coloured
    here (``experiments.plots.raster``), about a tenth of the bytes of the values, and the hover names each tile's
    head (the layer view gives each weight). A 64-token prompt change on the Attention page spent about 0.12 s of
    its 0.55 s in Chromium on the grid as a heatmap (Streamlit's chart wrapper copies and rewrites a figure's whole
    JSON on every redraw). The default keeps the values, numeric axes and a per-cell customdata hover (the
    ``python -m experiments.attention`` HTML file).

    Example:
        >>> fig = pattern_grid_figure(torch.full((1, 2, 3, 3), 1 / 3), light=True)
        >>> [trace.type for trace in fig.data], fig.data[0].source[:22]
        (['image', 'heatmap'], 'data:image/png;base64,')
    """
    p = to_numpy(patterns_LHPS)
    if p.ndim != 4:
        raise InputError(f"expected patterns [n_layers, n_heads, q, k], got shape {p.shape}")
    layers = list(range(p.shape[0])) if layers is None else list(layers)
    n_heads, n_queries, n_keys = p.shape[1], p.shape[2], p.shape[3]
    gap = max(1, n_queries // 8)
    z = _tile(p[layers].reshape(-1, n_queries, n_keys).astype(np.float64), n_heads, gap, np.nan)
    title = "Attention patterns (rows: layers, columns: heads)"
    if str_tokens is not None:
        if len(str_tokens) != n_keys:
            raise InputError(f"{len(str_tokens)} string tokens for patterns over {n_keys} positions")
        # Per-cell token hovers would weigh megabytes for a 270-head grid; the positions key is in the title.
        key = " ".join(f"{i}:{token_label(t)}" for i, t in enumerate(str_tokens))
        title += "<br><sup>" + (key if len(key) <= 160 else key[:157] + "...") + "</sup>"
    # Ticks name each tile at its middle column (row).
    x_ticks = [h * (n_keys + gap) + (n_keys - 1) / 2 for h in range(n_heads)]
    y_ticks = [r * (n_queries + gap) + (n_queries - 1) / 2 for r in range(len(layers))]
    if light:
        traces = [
            go.Image(source=colour_png(z, 0.0, zmax), x0=0, dx=1, y0=0, dy=1, hoverinfo="skip"),
            # One transparent cell a tile under the pointer: its hover names the head, its colour bar the scale.
            go.Heatmap(z=np.zeros((len(layers), n_heads)), x=x_ticks, y=y_ticks, opacity=0, showscale=True,
                       text=[[f"L{layer}H{h}" for h in range(n_heads)] for layer in layers],
                       hovertemplate="%{text}<extra></extra>"),
        ]
    else:
        traces = [go.Heatmap(z=z, customdata=_grid_customdata(layers, n_heads, n_queries, n_keys, gap), hoverongaps=False,
                             hovertemplate="L%{customdata[0]}H%{customdata[1]}<br>query %{customdata[2]}"
                                           "<br>key %{customdata[3]}<br>attention=%{z:.3f}<extra></extra>")]
    traces[-1].update(colorscale="Blues", zmin=0, zmax=zmax, colorbar=dict(title="attention"))
    fig = go.Figure(traces)
    fig.update_xaxes(tickmode="array", tickvals=x_ticks, ticktext=[f"H{h}" for h in range(n_heads)],
                     showgrid=False, zeroline=False)
    fig.update_yaxes(tickmode="array", tickvals=y_ticks, ticktext=[f"L{layer}" for layer in layers],
                     autorange="reversed", showgrid=False, zeroline=False)
    fig.update_layout(title=title,
                      height=max(400, 60 * len(layers) + 150), width=max(500, 70 * n_heads + 200),
                      plot_bgcolor="white")
    return fig


def _grid_customdata(layers: Sequence[int], n_heads: int, n_queries: int, n_keys: int, gap: int) -> np.ndarray:
    """Each cell's (layer, head, query, key) for the tiled grid's hover, NaN in the gaps: [rows, cols, 4].

    Numeric, so building it is vectorised.
    """
    layer_T = np.repeat(np.asarray(layers, dtype=np.float64), n_heads)
    head_T = np.tile(np.arange(n_heads, dtype=np.float64), len(layers))
    query_QK, key_QK = np.meshgrid(np.arange(n_queries), np.arange(n_keys), indexing="ij")
    cells_TQK4 = np.stack(np.broadcast_arrays(layer_T[:, None, None], head_T[:, None, None], query_QK[None],
                                              key_QK[None]), axis=-1)
    return _tile(cells_TQK4, n_heads, gap, np.nan)


def _tile(tiles_TQK: np.ndarray, n_cols: int, gap: int, blank) -> np.ndarray:
    """Tiles [T, Q, K, ...] laid out ``n_cols`` to a row, left to right, ``gap`` cells of ``blank`` between them (and
    filling a last row's empty places): [rows * (Q + gap) - gap, n_cols * (K + gap) - gap, ...] in the tiles' dtype.

    Example:
        >>> _tile(np.arange(12).reshape(3, 2, 2), 2, 1, -1)
        array([[ 0,  1, -1,  4,  5],
               [ 2,  3, -1,  6,  7],
               [-1, -1, -1, -1, -1],
               [ 8,  9, -1, -1, -1],
               [10, 11, -1, -1, -1]])
    """
    T, Q, K = tiles_TQK.shape[:3]
    n_rows = -(-T // n_cols)
    grid = np.full((n_rows * (Q + gap) - gap, n_cols * (K + gap) - gap, *tiles_TQK.shape[3:]), blank,
                   dtype=tiles_TQK.dtype)
    for t in range(T):
        row, col = divmod(t, n_cols)
        grid[row * (Q + gap):row * (Q + gap) + Q, col * (K + gap):col * (K + gap) + K] = tiles_TQK[t]
    return grid


def layer_patterns_figure(
    patterns_HPS: Float[Tensor, "n_heads pos key_pos"], str_tokens: Sequence[str], layer: int,
    key_labels: bool = False, heads: Optional[Sequence[int]] = None, tile_titles: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
) -> go.Figure:
    """Every head of one layer as tiles of one heatmap (up to four heads per row, blank gaps between them, one
    colour scale ``coloraxis``), each tile titled "L{layer}H{head}"; values as float32. ``heads``: the head numbers
    of ``patterns_HPS``'s rows when they are some of the layer's heads (default 0, 1, ...), ``tile_titles`` and
    ``title`` replace the tiles' and the figure's titles (default "Layer {layer}: every head").

    One trace on one pair of axes, not a subplot per head: Chromium drew SmolLM2's nine 64-token subplots (each
    with its own axes and ticks) in about 0.26 s of CPU, a quarter of a prompt change on the Attention page.
    The hover names the head (the cell's ``customdata``), the query and key tokens (the axes' category labels:
    each tile's, made distinct by zero-width spaces) and the weight. Query (y) labels are shown at the left of
    the rows up to ``MAX_LABELLED_TOKENS`` tokens; ``key_labels=True`` shows the key (x) labels too, rotated,
    under the bottom row (the tiles of a column share their keys), within the same limit, with ``KEY_LABEL_PX``
    more room below.

    Example:
        >>> fig = layer_patterns_figure(torch.full((2, 3, 3), 1 / 3), ["a", "b", "c"], 0, key_labels=True)
        >>> len(fig.data), fig.data[0]["z"].shape, [a["text"] for a in fig.layout.annotations]
        (1, (3, 7), ['L0H0', 'L0H1'])
        >>> fig.layout.height, fig.layout.xaxis.showticklabels
        (475, True)
        >>> some = layer_patterns_figure(torch.full((2, 3, 3), 1 / 3), ["a", "b", "c"], 4, heads=[7, 2], title="Two")
        >>> [a["text"] for a in some.layout.annotations], some.data[0]["customdata"][0].tolist(), some.layout.title.text
        (['L4H7', 'L4H2'], [7, 7, 7, 0, 2, 2, 2], 'Two')
    """
    p = to_numpy(patterns_HPS)
    if p.ndim != 3:
        raise InputError(f"expected one layer's patterns [n_heads, q, k], got shape {p.shape}")
    n_heads, n_queries, n_keys = p.shape
    if len(str_tokens) != n_keys or n_queries != n_keys:
        raise InputError(f"patterns of shape {p.shape} do not match {len(str_tokens)} tokens")
    heads = list(range(n_heads)) if heads is None else [int(h) for h in heads]
    tile_titles = [f"L{layer}H{h}" for h in heads] if tile_titles is None else list(tile_titles)
    if len(heads) != n_heads or len(tile_titles) != n_heads:
        raise InputError(f"{n_heads} patterns but {len(heads)} head numbers and {len(tile_titles)} tile titles")
    labels = axis_labels(list(str_tokens))
    labelled = len(labels) <= MAX_LABELLED_TOKENS
    show_keys = key_labels and labelled
    n_cols = min(4, n_heads)
    n_rows = (n_heads + n_cols - 1) // n_cols
    gap = max(1, n_keys // 8)
    step = n_keys + gap
    z = _tile(p.astype(np.float32, copy=False), n_cols, gap, np.nan)
    # The head of each cell for the hover (gaps are never hovered: hoverongaps=False); one or two bytes a cell.
    heads_H = np.asarray(heads, dtype=np.min_scalar_type(max(max(heads), 0)))
    head_of_cell = _tile(np.broadcast_to(heads_H[:, None, None], p.shape), n_cols, gap, 0)
    corners = [divmod(h, n_cols) for h in range(n_heads)]  # (tile row, tile column) of each head
    # Category axes: every column (row) of a tile is its token's label; gaps are blank labels.
    x = distinct_labels(_tiled(labels, n_cols, gap))
    y = distinct_labels(_tiled(labels, n_rows, gap))
    heatmap = dict(type="heatmap", z=z, x=x, y=y, customdata=head_of_cell, coloraxis="coloraxis", hoverongaps=False,
                   hovertemplate=f"L{layer}H%{{customdata}}<br>query %{{y}}<br>key %{{x}}<br>attention=%{{z:.3f}}"
                                 "<extra></extra>")
    height = 300 * n_rows + 100 + (KEY_LABEL_PX if show_keys else 0)
    titles = [dict(text=tile_titles[h], x=col * step + (n_keys - 1) / 2, y=row * step - 0.5, xref="x", yref="y",
                   xanchor="center", yanchor="bottom", showarrow=False, font=dict(size=14))
              for h, (row, col) in enumerate(corners)]
    axis = dict(type="category", showgrid=False, zeroline=False, ticks="", automargin=True)
    layout = dict(
        title=dict(text=f"Layer {layer}: every head" if title is None else title), height=height,
        width=300 * n_cols + 150,
        coloraxis=dict(colorscale=colorscale_json("Blues"), cmin=0, cmax=1, colorbar=dict(title=dict(text="attention"))),
        plot_bgcolor="white", annotations=titles,
        xaxis=dict(axis, showticklabels=True, tickmode="array", tickvals=_tile_ticks(x, n_keys, n_cols, gap),
                   tickangle=-90, tickfont=dict(size=9)) if show_keys else dict(axis, showticklabels=False),
        yaxis=dict(axis, autorange="reversed", showticklabels=labelled,
                   **(dict(tickmode="array", tickvals=_tile_ticks(y, n_keys, n_rows, gap)) if labelled else {})),
        margin=dict(t=100, b=20 + (KEY_LABEL_PX if show_keys else 0)),
    )
    return go.Figure(data=[heatmap], layout=layout, _validate=False)


def _tiled(labels: Sequence[str], n_tiles: int, gap: int) -> list[str]:
    """``labels`` repeated for ``n_tiles`` tiles, ``gap`` blank labels between tiles (an axis of a tiled heatmap).

    Example:
        >>> _tiled(["a", "b"], 2, 1)
        ['a', 'b', ' ', 'a', 'b']
    """
    out: list[str] = []
    for tile in range(n_tiles):
        out += ([" "] * gap if tile else []) + list(labels)
    return out


def _tile_ticks(categories: Sequence[str], size: int, n_tiles: int, gap: int) -> list[str]:
    """The categories of every tile's cells (gaps left out): where a tiled axis puts its tick labels.

    Example:
        >>> _tile_ticks(["a", "b", " ", "a2", "b2"], size=2, n_tiles=2, gap=1)
        ['a', 'b', 'a2', 'b2']
    """
    return [categories[tile * (size + gap) + i] for tile in range(n_tiles) for i in range(size)]
