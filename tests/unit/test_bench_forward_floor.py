"""The cache-all benchmark's memory floor: its probes write what they say, and the floor is the hand sum."""

import pytest
import torch

from tests.benchmarks.bench_forward import (CACHE_REFERENCE, NOTHING_KEPT, PROBE_DROPPED, PROBE_KEPT, floor_ratio,
                                            refilling, writing_activations)


def test_the_kept_probe_keeps_one_written_tensor_per_shape_and_the_dropped_one_keeps_none():
    shapes = [torch.Size([1, 4, 8]), torch.Size([1, 2, 4, 4]), torch.Size([1, 4, 1])]
    kept = writing_activations(shapes, keep=True)()
    assert [tensor.shape for tensor in kept] == shapes
    assert all(torch.equal(tensor, torch.ones(tensor.shape)) for tensor in kept)
    assert len({tensor.data_ptr() for tensor in kept}) == len(shapes)  # each in memory of its own
    assert writing_activations(shapes, keep=False)() == []


def test_the_refilling_probe_writes_into_the_same_tensors_every_call():
    buffers = [torch.zeros(2, 3), torch.zeros(4)]
    pointers = [tensor.data_ptr() for tensor in buffers]
    refilled = refilling(buffers)()
    assert [tensor.data_ptr() for tensor in refilled] == pointers
    assert all(torch.equal(tensor, torch.ones(tensor.shape)) for tensor in refilled)


def test_floor_is_nothing_kept_plus_what_keeping_the_writes_costs_over_the_reference():
    times = {CACHE_REFERENCE: [0.20, 0.10, 0.30],  # median 0.20
             NOTHING_KEPT: [0.21, 0.22, 0.90],  # median 0.22
             PROBE_KEPT: [0.05, 0.03, 0.04],  # median 0.04
             PROBE_DROPPED: [0.01, 0.01, 0.02]}  # median 0.01
    # (0.22 + (0.04 - 0.01)) / 0.20
    assert floor_ratio(times, CACHE_REFERENCE) == pytest.approx(1.25)
