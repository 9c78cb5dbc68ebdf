"""Batched experiments on CUDA (skipped without CUDA): the head sweep's tiled loss keeps its
tensors on the model's device and equals a per-head loop run on the same GPU."""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from experiments.ablation import head_sweep
from tests.benchmarks.bench_head_sweep import loop_sweep  # one run_with_hooks per head

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Vocabulary of 3,000: three logits tiles of the loss, the last one ragged.
CONFIG = dict(n_layers=3, d_model=128, n_heads=4, n_key_value_heads=2, d_mlp=256, d_vocab=3000, n_ctx=64,
              normalization="RMS", positional="rotary", act_fn="silu", gated_mlp=True)


def test_head_sweep_on_cuda_equals_a_per_head_loop_there():
    torch.manual_seed(0)
    model = wb.Decoder(wb.ModelConfig(**CONFIG)).to(DEVICE).eval()
    tokens = torch.randint(0, 3000, (2, 20), device=DEVICE)
    with torch.no_grad():
        expected = torch.tensor(loop_sweep(model, tokens))
    df = head_sweep(model, tokens, progress=False)
    torch.testing.assert_close(torch.tensor(df.metric.values), expected, rtol=0, atol=1e-4)
