"""``token_losses_from_normed`` (the loss made tile by tile) against ``F.cross_entropy`` of the full logits.

The tiles here are 5 positions x 16 of 61 vocabulary entries (ragged at both ends), so every path of the
tile loop runs: the shift folded into the GEMM (plain float32), the shift subtracted after a bias and a
soft cap, the reused tile buffer under no_grad and fresh tiles under autograd, and the rows whose later
logits lie far above the first tile's (the shifted sum would overflow) redone with a per-tile maximum.
"""

import pytest
import torch
import torch.nn.functional as F

import workbench.loss
from workbench.loss import token_losses_from_normed

D, V = 24, 61


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(workbench.loss, "TILE_POSITIONS", 5)
    monkeypatch.setattr(workbench.loss, "TILE_VOCAB", 16)


def inputs(scale: float = 1.0):
    torch.manual_seed(0)
    return torch.randn(2, 6, D) * scale, torch.randn(V, D) * 0.5, torch.randint(0, V, (2, 6))


def reference(x, W, targets, bias=None, cap=None):
    logits = F.linear(x, W, bias)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="none").view(targets.shape)


@pytest.mark.parametrize("grad", [False, True])
def test_plain_float32_losses_equal_cross_entropy(grad):
    x, W, targets = inputs()
    with torch.set_grad_enabled(grad):
        losses = token_losses_from_normed(x, W, targets)
    torch.testing.assert_close(losses, reference(x, W, targets), rtol=0, atol=1e-5)


def test_a_bias_and_a_soft_cap_are_applied_before_the_softmax():
    x, W, targets = inputs(scale=3.0)
    bias = torch.linspace(-2.0, 2.0, V)
    losses = token_losses_from_normed(x, W, targets, bias, soft_cap=5.0)
    torch.testing.assert_close(losses, reference(x, W, targets, bias, 5.0), rtol=0, atol=1e-5)


def test_rows_whose_later_logits_would_overflow_the_shifted_sum_are_exact():
    x, W, targets = inputs()
    W[40:] *= 60.0  # logits of hundreds past the first tile: exp(logit - first tile's lse) overflows float32
    expected = reference(x, W, targets)
    assert torch.isfinite(expected).all() and expected.max() > 50  # the full-logits loss stays finite
    torch.testing.assert_close(token_losses_from_normed(x, W, targets), expected, rtol=1e-6, atol=1e-4)


def test_the_gradient_through_the_tiles_is_the_full_logits_gradient():
    x, W, targets = inputs()
    x_tiles, x_full = x.clone().requires_grad_(), x.clone().requires_grad_()
    token_losses_from_normed(x_tiles, W, targets).sum().backward()
    reference(x_full, W, targets).sum().backward()
    torch.testing.assert_close(x_tiles.grad, x_full.grad, rtol=0, atol=1e-5)
