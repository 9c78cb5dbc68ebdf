"""Circuits on CUDA (skipped without CUDA): exact edge patching and EAP keep their tensors on the model's device.

Expected values: the CPU suite's checks (``tests/unit/test_circuits_exact.py``) run on the GPU: the corrupted run
with one reader's input replaced wholesale by the clean run's through the model's own hooks (what every edge into
that reader patched together must give) and single edges patched one at a time, both there; and EAP's scores from
the same weights on the CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from experiments.circuits import edge_attribution_patching
from tests.unit.helpers import make_model
from tests.unit.test_circuits_exact import (CORRUPT, METRIC, TOKENS, assert_batched_edges_equal_one_at_a_time,
                                            assert_every_edge_into_a_reader_patches_its_input_wholesale)

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_exact_edge_patching_on_cuda_matches_the_hooks_and_single_edges_there():
    assert_every_edge_into_a_reader_patches_its_input_wholesale(make_model("mha_learned_ln").to(DEVICE), atol=1e-4)
    assert_batched_edges_equal_one_at_a_time(make_model("gqa_rotary_rms_swiglu").to(DEVICE), atol=1e-4)


def test_eap_on_cuda_equals_eap_of_the_same_weights_on_the_cpu():
    cpu_model = make_model("gqa_rotary_rms_swiglu")
    cuda_model = copy.deepcopy(cpu_model).to(DEVICE)
    for method in ("eap", "eap-ig"):
        on_cpu = edge_attribution_patching(cpu_model, TOKENS, CORRUPT, METRIC, method=method, ig_steps=3)
        on_cuda = edge_attribution_patching(cuda_model, TOKENS.to(DEVICE), CORRUPT.to(DEVICE), METRIC, method=method,
                                            ig_steps=3)
        torch.testing.assert_close(on_cuda.scores, on_cpu.scores, rtol=1e-4, atol=1e-4)
