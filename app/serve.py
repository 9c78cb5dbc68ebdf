"""The dashboard's server: ``python -m app.serve [options of streamlit run]`` is ``streamlit run app/Home.py
[options]`` with the default model loading from the moment the server launches.

Streamlit has no server-start hook: a page can start loading the model only when a browser first opens it, after
the server has started and the page's imports have run. Here a background thread starts the session's default
model (``app.results.models.warm_model``, the registry's default name and kernel, as a new session's
``app.state`` picks them) and the page modules' imports, then Streamlit's own command line runs in this same
process: the first page's ``results.load_model`` (kept once per process) finds the model loaded, or waits for
the same load, never a second copy. A failed warm-up is only logged; the page's own load tries again and shows its
message. A page that runs while the warm-up does (Home, Attention) first has the browser load plotly.js
(``preload_plotly_while_warming``), which it would otherwise do only when the page's first figure arrives.

    python -m app.serve --server.port 8502          # what `make run` and the browser tests start
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

HOME = Path(__file__).resolve().parent / "Home.py"
_WARMING: Optional[threading.Thread] = None  # the warm-up thread this process started, if any


def streamlit_argv(options: Sequence[str]) -> list[str]:
    """The ``streamlit`` command line this launcher hands over to: ``streamlit run app/Home.py [options]``.

    Example:
        >>> streamlit_argv(["--server.port", "8502"])[:2], streamlit_argv([])[2].endswith("Home.py")
        (['streamlit', 'run'], True)
    """
    return ["streamlit", "run", str(HOME), *options]


def _wait_for_the_server(limit_s: float = 5.0) -> None:
    """Returns once Streamlit's runtime has started (the server answers, so a browser can fetch the page and parse
    its scripts while the imports below run), or after ``limit_s``: the imports hold the GIL, and started at once
    they delayed the server's first answer by 0.4-0.6 s."""
    from streamlit import runtime
    from streamlit.runtime.runtime import RuntimeState

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if runtime.exists() and runtime.get_instance().state != RuntimeState.INITIAL:
            return
        time.sleep(0.02)


def _warm_default_model(wait_for_server: bool) -> None:
    if wait_for_server:
        _wait_for_the_server()
    import workbench as wb
    from app import state
    from app.results.models import warm_model
    from app.runtime import leave_a_core_free

    leave_a_core_free()  # the threads the pages would set, before the load competes with the server's start
    warm_model(wb.default_model_name(), state.DEFAULT_IMPL).join()
    # What every page imports, loaded while the server starts and the browser fetches the page.
    import app.widgets  # noqa: F401
    import experiments.plots.attention  # noqa: F401


def still_warming() -> bool:
    """Whether this process's warm-up (``start_warming``) is still running: the default model or the pages' imports
    are still loading (False in a process that never started one, as under ``streamlit run`` or in tests).

    Example:
        >>> still_warming()
        False
    """
    return _WARMING is not None and _WARMING.is_alive()


def preload_plotly_while_warming() -> None:
    """On a page's run while the server is still warming up: an empty plotly chart, hidden, so that the browser
    fetches and compiles plotly.js (Streamlit loads it, 4.6 MB, with a page's first chart) during the seconds the
    server spends importing torch and loading the model, not after the page's first figure has arrived. Call it
    before the page's own imports, which wait for the warm-up's. Cold start on a 2-core machine: the first
    heatmap was drawn 1.5-2 s after the figure arrived, most of it plotly.js loading (issue 52).

    Example (in a page script, before its heavy imports):
        >>> preload_plotly_while_warming()   # doctest: +SKIP
    """
    if not still_warming():
        return
    # plotly's figure checks read pandas from sys.modules without the import lock: pandas half imported by the
    # warm-up thread fails them. Importing it here waits for that import to finish (or does it).
    import pandas  # noqa: F401
    import streamlit as st

    st.html("<style>.st-key-plotly_preload {display: none}</style>")  # style only: takes no room on the page
    with st.container(key="plotly_preload"):
        st.plotly_chart({"data": [{"type": "scatter", "x": [], "y": []}], "layout": {}}, key="plotly_preload_chart",
                        theme=None)


def start_warming(wait_for_server: bool = True) -> threading.Thread:
    """Starts loading the default model (and the pages' common imports) in a daemon thread, once Streamlit's server
    has started (at once without ``wait_for_server``; it waits at most 5 s); returns the thread.

    Example:
        >>> start_warming(wait_for_server=False).join()   # doctest: +SKIP
    """
    from app import serve  # the module the pages import: under `python -m app.serve` this file runs as __main__

    thread = threading.Thread(target=_warm_default_model, args=(wait_for_server,), name="warm default model",
                              daemon=True)
    thread.start()
    serve._WARMING = thread
    return thread


def main(options: Optional[Sequence[str]] = None) -> None:
    """Starts the warm-up, then runs ``streamlit run app/Home.py [options]`` in this process (returns when the
    server stops; exits with Streamlit's status on an error).

    Example:
        >>> main(["--server.port", "8502", "--server.headless", "true"])   # doctest: +SKIP
    """
    start_warming()
    from streamlit.web import cli

    sys.argv = streamlit_argv(sys.argv[1:] if options is None else options)
    cli.main()


if __name__ == "__main__":
    main()
