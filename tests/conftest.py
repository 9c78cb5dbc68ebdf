"""Shared test set-up: no hub access, deterministic seeds, a place for test output."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
