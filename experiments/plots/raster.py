"""Value grids as colour-mapped PNG images: a heatmap the browser only has to paint.

A plotly heatmap sends every value (4 bytes a cell as float32) and the browser maps each to a colour, behind
Streamlit's chart wrapper, which copies the figure's JSON and rewrites its colours on every redraw. For an
overview of hundreds of thousands of cells the colours can be worked out here instead and sent as a PNG (a
tenth of the bytes), drawn as a plotly ``image`` trace.
"""

from __future__ import annotations

import base64
import functools
import io

import numpy as np
import plotly.colors
from jaxtyping import Float

from experiments.plots.common import colorscale_json
from workbench.errors import InputError


@functools.cache  # read-only arrays: one parse of each scale per process
def colorscale_stops(name: str) -> tuple[np.ndarray, np.ndarray]:
    """A named plotly colour scale as (positions [n], RGB [n, 3]) with positions from 0 to 1: the stops of
    ``colorscale_json(name)``, the scale a heatmap's figure names.

    Example:
        >>> positions, rgb = colorscale_stops("Blues")
        >>> float(positions[0]), float(positions[-1]), rgb[0].tolist(), rgb[-1].tolist()
        (0.0, 1.0, [247.0, 251.0, 255.0], [8.0, 48.0, 107.0])
    """
    scale = colorscale_json(name)
    positions = np.array([position for position, _ in scale], dtype=np.float64)
    rgb = np.array([plotly.colors.unlabel_rgb(plotly.colors.convert_colors_to_same_type([colour], "rgb")[0][0])
                    for _, colour in scale], dtype=np.float64)
    positions.setflags(write=False)
    rgb.setflags(write=False)
    return positions, rgb


def colour_png(values: Float[np.ndarray, "rows cols"], zmin: float, zmax: float, colorscale: str = "Blues") -> str:
    """``values`` coloured as plotly colours a heatmap (linear between the scale's stops, clipped to
    ``zmin``..``zmax``), NaN cells transparent, as a ``data:image/png;base64,...`` URI: one pixel a cell, for a
    plotly ``image`` trace's ``source``.

    Example:
        >>> uri = colour_png(np.array([[0.0, 1.0], [np.nan, 0.5]]), 0.0, 1.0)
        >>> uri.startswith("data:image/png;base64,")
        True
    """
    from PIL import Image  # Streamlit's own dependency; only the dashboard's figures need it

    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.size == 0:
        raise InputError(f"expected a non-empty 2-d grid of values, got shape {values.shape}")
    if not zmax > zmin:
        raise InputError(f"the colour range needs zmax > zmin, got {zmin} .. {zmax}")
    positions, rgb = colorscale_stops(colorscale)
    where = np.clip((np.nan_to_num(values, nan=zmin) - zmin) / (zmax - zmin), 0.0, 1.0)
    channels = [np.interp(where, positions, rgb[:, c]) for c in range(3)]
    alpha = np.where(np.isnan(values), 0.0, 255.0)
    rgba = np.rint(np.stack(channels + [alpha], axis=-1)).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buffer, "PNG", compress_level=1)  # speed over size: sent once, drawn once
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
