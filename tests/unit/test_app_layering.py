"""The dashboard's layers: importing it does nothing, ``app/results/`` is the one cache layer and
looks only down, and the figure builders produce the light figures the pages used to make by hand.

Expected labels, gaps and layout numbers are worked out by hand in each test.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.plots.attention import layer_patterns_figure, pattern_grid_figure

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "app"
RESULTS = APP / "results"
# Every importable app module (Home.py and pages/ are scripts: running them is starting the dashboard).
APP_MODULES = ["app"] + sorted([f"app.{path.stem}" for path in APP.glob("*.py") if path.stem not in ("Home", "__init__")]
                               + ["app.results"] + [f"app.results.{path.stem}" for path in RESULTS.glob("[!_]*.py")])
# What the pages import besides app modules.
PAGE_HELPERS = ["experiments.ablation", "experiments.attention", "experiments.continuations", "experiments.datasets",
                "experiments.features", "experiments.flow", "experiments.heads", "experiments.induction",
                "experiments.lens", "experiments.neurons", "experiments.patching", "experiments.router",
                "experiments.token_view", "experiments.plots", "experiments.steering", "experiments.probes",
                "experiments.lenses"]
SENTINEL_THREADS = (os.cpu_count() or 1) + 3  # never what "leave a core free" would choose

IMPORT_PROBE = f"""
import json, os, sys
import torch, streamlit, plotly  # third-party imports first: only the project's own effects are measured
torch.set_num_threads({SENTINEL_THREADS})
env_before, threads_before = dict(os.environ), torch.get_num_threads()
import app.results
app_modules_under_results = sorted(name for name in sys.modules if name.startswith("app."))
for name in {APP_MODULES + PAGE_HELPERS!r}:
    __import__(name)
report = dict(threads=[threads_before, torch.get_num_threads()], env_changed=sorted(
    key for key in set(env_before) | set(os.environ) if env_before.get(key) != os.environ.get(key)),
    app_modules_under_results=app_modules_under_results)
from app.runtime import leave_a_core_free
leave_a_core_free()
report["threads_once_started"] = torch.get_num_threads()
torch.set_num_threads({SENTINEL_THREADS})
leave_a_core_free()
report["threads_after_second_call"] = torch.get_num_threads()
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def import_report() -> dict:
    """What importing every app module did, measured in a fresh interpreter (one start for all checks)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "BROWSER_PATH")}
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE], cwd=REPO, env={**env, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_app_modules_list_is_complete():
    assert {"app.results", "app.results.models", "app.results.long_runs", "app.state", "app.widgets", "app.downloads",
            "app.runtime"} <= set(APP_MODULES)


def test_importing_the_app_changes_neither_threads_nor_environment(import_report):
    assert import_report["threads"] == [SENTINEL_THREADS, SENTINEL_THREADS]
    assert import_report["env_changed"] == []


def test_the_dashboard_leaves_a_core_free_once_when_it_starts(import_report):
    assert import_report["threads_once_started"] == max(1, (os.cpu_count() or 1) - 1)
    assert import_report["threads_after_second_call"] == SENTINEL_THREADS  # applied once, not on every page


def test_results_imports_no_widget_or_page(import_report):
    under_results = import_report["app_modules_under_results"]
    assert "app.results" in under_results and "app.state" in under_results
    assert all(name == "app.state" or name.split(".")[:2] == ["app", "results"] for name in under_results), under_results
    imported = set()
    for path in RESULTS.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {f"app.{alias.name}" for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module == "app" for alias in node.names}
    assert "app.state" in imported
    assert not {name for name in imported if name == "app.widgets" or name.startswith("app.pages")}


def test_only_results_caches():
    sources = {path.relative_to(APP).as_posix(): path.read_text() for path in APP.rglob("*.py")}
    assert "pages/1_Attention.py" in sources and len(sources) >= 12
    caching = sorted(name for name, text in sources.items() if "cache_data" in text or "cache_resource" in text)
    assert caching and all(name.startswith("results/") for name in caching), caching
    results = "".join(text for name, text in sources.items() if name.startswith("results/"))
    # the models, the stores of results kept by reference (``long_runs.held_store``: the long runs, and the Logit lens
    # page's runs, read-only tensors every attribution reads, which pickling per reader made slower than the
    # readout), the opened SAEs and transcoder sets (the one holder, app.results.artifacts) and a transcoder set's
    # layers seen as SAEs (app.results.attribution) are resources; every cached result is data
    assert results.count("@st.cache_resource") == 4 and results.count("@st.cache_data") >= 7
    assert "def load_model(" in sources["results/models.py"]


def _png_pixels(uri: str) -> np.ndarray:
    from PIL import Image

    assert uri.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGBA"))


def test_light_grid_is_an_image_coloured_as_plotly_colours_blues_with_a_hover_per_tile():
    patterns = torch.zeros(1, 2, 3, 3)  # 1 layer, 2 heads, 3 positions
    patterns[0, 0, 0, 0], patterns[0, 0, 1, 0], patterns[0, 1, 2, 2] = 0.5, 0.0625, 0.75  # 0.75 > zmax: clipped
    fig = pattern_grid_figure(patterns, ["a", "b", "c"], light=True, zmax=0.5)
    image, tiles = fig.data
    pixels = _png_pixels(image.source)
    # gap = max(1, 3 // 8) = 1 column between the heads' 3-column tiles: 3 + 1 + 3 = 7 columns, one pixel a cell.
    assert pixels.shape == (3, 7, 4) and image.hoverinfo == "skip"
    assert (pixels[:, 3, 3] == 0).all() and (np.delete(pixels, 3, axis=1)[..., 3] == 255).all()  # gaps see-through
    # Plotly's "Blues" stops (plotly.colors.sequential.Blues): 0 rgb(247,251,255), 0.125 rgb(222,235,247),
    # 0.25 rgb(198,219,239), ..., 1 rgb(8,48,107). A cell's colour is linear between the stops around value/zmax.
    assert pixels[0, 0, :3].tolist() == [8, 48, 107]       # 0.5 / 0.5 = 1: the last stop
    assert pixels[1, 0, :3].tolist() == [222, 235, 247]    # 0.0625 / 0.5 = 0.125: the second stop
    assert pixels[0, 1, :3].tolist() == [247, 251, 255]    # 0: the first stop
    assert pixels[2, 6, :3].tolist() == [8, 48, 107]       # head 1, query 2, key 2: 0.75 clipped to zmax
    halfway = pattern_grid_figure(torch.full((1, 1, 3, 3), 0.1875), light=True, zmax=1.0)
    # 0.1875: halfway between the stops at 0.125 and 0.25: (222 + 198) / 2, (235 + 219) / 2, (247 + 239) / 2.
    assert _png_pixels(halfway.data[0].source)[0, 0, :3].tolist() == [210, 227, 243]
    # The hover: one transparent cell a tile, at its middle, naming the head; its colour bar is the scale.
    assert list(tiles.x) == [1.0, 5.0] and list(tiles.y) == [1.0] and tiles.opacity == 0
    assert [list(row) for row in tiles.text] == [["L0H0", "L0H1"]] and (tiles.zmin, tiles.zmax) == (0, 0.5)


def test_light_grid_names_the_chosen_layers_and_the_row_gaps():
    patterns = torch.full((3, 1, 3, 3), 1 / 3)
    fig = pattern_grid_figure(patterns, layers=[0, 2], light=True)
    assert _png_pixels(fig.data[0].source).shape == (7, 3, 4)  # two 3-row tiles and a 1-row gap
    assert (_png_pixels(fig.data[0].source)[3, :, 3] == 0).all()
    assert list(fig.layout.yaxis.tickvals) == [1.0, 5.0] and list(fig.layout.yaxis.ticktext) == ["L0", "L2"]
    assert [list(row) for row in fig.data[1].text] == [["L0H0"], ["L2H0"]]


def test_default_grid_keeps_numeric_axes_and_the_customdata_hover():
    patterns = torch.full((1, 2, 3, 3), 1 / 3)
    fig = pattern_grid_figure(patterns)
    custom = np.asarray(fig.data[0].customdata, dtype=float)
    assert custom.shape == (3, 7, 4)
    assert list(custom[2, 5]) == [0, 1, 2, 1]  # row 2, column 5: layer 0, head 1, query 2, key 5 - 4 = 1
    assert np.isnan(custom[:, 3]).all()
    assert fig.data[0].z.dtype == np.float64 and fig.layout.xaxis.type is None and fig.data[0].hoverongaps is False
    # each tile's middle cell: cells sit at whole positions, so a 3-cell tile's middle is 1 (then 1 + 4)
    assert list(fig.layout.xaxis.tickvals) == [1.0, 5.0] and list(fig.layout.yaxis.tickvals) == [1.0]


def test_layer_figure_tiles_every_head_in_one_heatmap():
    patterns = torch.arange(5 * 9, dtype=torch.float32).reshape(5, 3, 3) / 45  # 5 heads: 2 rows of 4 columns
    fig = layer_patterns_figure(patterns, ["a", "b", "c"], 1)
    assert len(fig.data) == 1 and fig.data[0].type == "heatmap" and fig.layout.title.text == "Layer 1: every head"
    trace = fig.data[0]
    # gap = max(1, 3 // 8) = 1: 4 tiles of 3 columns and 3 gaps = 15 columns; 2 tiles of 3 rows and 1 gap = 7 rows.
    assert trace.z.dtype == np.float32 and trace.z.shape == (7, 15)
    tiles = {0: (0, 0), 1: (0, 4), 2: (0, 8), 3: (0, 12), 4: (4, 0)}  # head: (top row, left column), by hand
    for head, (top, left) in tiles.items():
        np.testing.assert_array_equal(trace.z[top:top + 3, left:left + 3], patterns[head].numpy())
        assert (np.asarray(trace.customdata)[top:top + 3, left:left + 3] == head).all()  # the hover's head
    assert np.isnan(trace.z[3]).all() and np.isnan(trace.z[:, [3, 7, 11]]).all()  # the gaps
    assert np.isnan(trace.z[4:, 4:]).all()  # the second row's three unused tiles
    assert trace.coloraxis == "coloraxis" and trace.hoverongaps is False
    assert trace.hovertemplate == "L1H%{customdata}<br>query %{y}<br>key %{x}<br>attention=%{z:.3f}<extra></extra>"
    # Category axes: each tile's cells are named by their tokens (repeats kept apart by zero-width spaces).
    labels = ["0: 'a'", "1: 'b'", "2: 'c'"]
    assert [x.rstrip("\u200b") for x in trace.x] == labels + [" "] + labels + [" "] + labels + [" "] + labels
    assert [y.rstrip("\u200b") for y in trace.y] == labels + [" "] + labels
    assert len(set(trace.x)) == 15 and len(set(trace.y)) == 7
    # Each tile's title sits on its top edge (row index - 0.5), centred on its middle column.
    titles = [(a.text, a.x, a.y) for a in fig.layout.annotations]
    assert titles == [("L1H0", 1, -0.5), ("L1H1", 5, -0.5), ("L1H2", 9, -0.5), ("L1H3", 13, -0.5), ("L1H4", 1, 3.5)]
    assert fig.layout.coloraxis.cmin == 0 and fig.layout.coloraxis.cmax == 1
    assert list(fig.layout.coloraxis.colorscale[0]) == [0.0, "rgb(247,251,255)"]  # ColorBrewer Blues: white at 0
    assert fig.layout.yaxis.autorange == "reversed"  # the first query at the top


def test_key_labels_under_the_tiles_and_not_past_forty_tokens():
    patterns = torch.full((2, 3, 3), 1 / 3)  # 2 heads: one row of two tiles
    plain = layer_patterns_figure(patterns, ["a", "b", "c"], 0)
    assert plain.layout.height == 300 + 100 and plain.layout.width == 2 * 300 + 150
    assert plain.layout.xaxis.showticklabels is False and plain.layout.yaxis.showticklabels is True
    fig = layer_patterns_figure(patterns, ["a", "b", "c"], 0, key_labels=True)
    assert fig.layout.height == 300 + 100 + 75 and fig.layout.margin.b == 20 + 75
    x = fig.data[0].x
    assert fig.layout.xaxis.showticklabels is True and fig.layout.xaxis.tickangle == -90
    assert list(fig.layout.xaxis.tickvals) == [x[0], x[1], x[2], x[4], x[5], x[6]]  # every tile's keys, no gap
    assert list(fig.layout.yaxis.tickvals) == list(fig.data[0].y)  # one row of tiles: every row is a query
    long = layer_patterns_figure(torch.full((2, 41, 41), 1 / 41), [f"t{i}" for i in range(41)], 0, key_labels=True)
    assert long.layout.height == 400 and long.layout.margin.b == 20
    assert long.layout.xaxis.showticklabels is False and long.layout.yaxis.showticklabels is False


def test_layer_figure_is_valid_plotly_and_rejects_mismatched_tokens():
    import plotly.graph_objects as go

    from workbench.errors import InputError

    fig = layer_patterns_figure(torch.full((5, 3, 3), 1 / 3), ["a", "b", "c"], 2, key_labels=True)
    go.Figure(fig.to_dict())  # built without plotly's validation: every property must still be a real one
    with pytest.raises(InputError, match="2 tokens"):
        layer_patterns_figure(torch.full((2, 3, 3), 1 / 3), ["a", "b"], 0)
