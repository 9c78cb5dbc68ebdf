"""Drawing results with their download buttons: tables as CSV, figures as HTML and PNG.

Files are produced only when a button is clicked (Streamlit's deferred ``data`` callables), so
a page does not pay for a 4 MB HTML file or a PNG render on every rerun. PNGs are rendered by
kaleido, which drives a Chrome; Debian's /usr/bin/chromium is used when no other is named
(handed to kaleido when a PNG is rendered, never on import). Without kaleido the PNG comes
from the camera button in each figure's toolbar (client side).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Optional, Union

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

_DEBIAN_CHROMIUM = "/usr/bin/chromium"
_BROWSER_VARIABLE = "BROWSER_PATH"  # where kaleido (choreographer) looks for Chrome first


def _named_browser() -> Optional[str]:
    """The Chrome kaleido should drive: BROWSER_PATH when it names one that exists, else Debian's Chromium."""
    for browser in (os.environ.get(_BROWSER_VARIABLE), _DEBIAN_CHROMIUM):
        if browser and Path(browser).exists():
            return browser
    return None


def png_export_available() -> bool:
    """Whether figures can be rendered to PNG on the server: kaleido installed and a Chrome to drive.

    Example:
        >>> isinstance(png_export_available(), bool)
        True
    """
    if importlib.util.find_spec("kaleido") is None:
        return False
    return _named_browser() is not None or any(
        shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome", "chrome"))


def png_bytes(fig: go.Figure) -> bytes:
    """``fig`` rendered to a PNG at twice its size by kaleido, driving the Chrome ``_named_browser`` picks.

    plotly's ``to_image`` takes no browser argument and kaleido looks in BROWSER_PATH first, so
    the variable is set here, at the first render and only when no one has set it: kaleido then
    drives the browser ``png_export_available`` counted on.

    Example:
        >>> png_bytes(go.Figure()).startswith(b"\\x89PNG")   # doctest: +SKIP
        True
    """
    browser = _named_browser()
    if browser and _BROWSER_VARIABLE not in os.environ:
        os.environ[_BROWSER_VARIABLE] = browser
    return fig.to_image(format="png", scale=2)


def _file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "result"


def _visible_tokens(df: pd.DataFrame) -> pd.DataFrame:
    """Token-text columns quoted (repr) so whitespace tokens such as "\\n" or " " are visible on screen."""
    text_columns = [c for c in df.columns if c == "token" or str(c).endswith("_token")]
    quoted = {c: df[c].map(lambda t: repr(t) if isinstance(t, str) else t) for c in text_columns}
    return df.assign(**quoted) if quoted else df


def table(df: pd.DataFrame, name: str, key: str, **dataframe_kwargs) -> None:
    """A sortable table (click a column header) with a CSV download button under it.

    Token texts are shown quoted; the CSV keeps them as they are.

    Example:
        >>> table(head_summary_df, "head_summary", key="summary")   # doctest: +SKIP
    """
    st.dataframe(_visible_tokens(df), hide_index=True, **dataframe_kwargs)
    st.download_button("Download CSV", df.to_csv(index=False), f"{_file_stem(name)}.csv", "text/csv",
                       key=f"{key}_csv", on_click="ignore", icon=":material/download:")


def figure(fig: go.Figure, name: str, key: str, stretch: bool = True,
           on_select: Union[None, str, Callable[[], None]] = None) -> Optional[list[dict]]:
    """A plotly figure with HTML (and, with kaleido, PNG) download buttons under it.

    The toolbar's camera button also saves a PNG, named after ``name``, in the browser. With
    ``on_select`` ("rerun" or a callback) a click on a point or a heatmap cell is reported: the
    clicked points are returned (``[]`` when none), and a callback finds them in
    ``st.session_state[f"{key}_chart"]``.

    Example:
        >>> figure(scores_heatmap(scores, "Induction"), "induction_scores", key="induction")   # doctest: +SKIP
        >>> points = figure(heads_map, "heads", key="heads", on_select="rerun")               # doctest: +SKIP
    """
    stem = _file_stem(name)
    config = {"toImageButtonOptions": {"format": "png", "filename": stem, "scale": 2}, "displaylogo": False}
    selectable = dict(on_select=on_select, selection_mode="points") if on_select else {}
    # plotly.js hides numeric axes' tick labels that would overflow the figure ("hide past div", its default off
    # category axes) by measuring every label once per label drawn: quadratic in the labels. A 64-token prompt change
    # on Information flow spent 0.1 s of the browser's time there. Labels past the edge are cut off anyway.
    fig.update_xaxes(ticklabeloverflow="allow")
    fig.update_yaxes(ticklabeloverflow="allow")
    # theme=None: the page shows the figure exactly as its HTML/PNG download will (and draws it sooner).
    event = st.plotly_chart(fig, width="stretch" if stretch else "content", config=config, key=f"{key}_chart",
                            theme=None, **selectable)
    with st.container(horizontal=True):  # buttons side by side at their own width, in any column
        st.download_button("HTML", lambda: fig.to_html(include_plotlyjs=True, full_html=True),
                           f"{stem}.html", "text/html", key=f"{key}_html", on_click="ignore",
                           icon=":material/download:", help="A standalone interactive page (works offline)")
        if png_export_available():
            st.download_button("PNG", lambda: png_bytes(fig), f"{stem}.png", "image/png",
                               key=f"{key}_png", on_click="ignore", icon=":material/download:",
                               help="Rendered on the server with kaleido; takes a few seconds")
        else:
            st.caption("PNG: camera icon in the figure's toolbar")
    return list(event.selection.points) if on_select and event is not None else None
