"""The activations of a sparse dictionary, one copy each, shared by inference (``workbench.sae.math``,
``workbench.transcoders``) and training (``experiments.sae``).

Legend: N flattened tokens, X d_sae.

(Any leading axes are allowed where ``...`` is written.)

- ``relu``: ``max(pre, 0)``;
- ``jumprelu``: SAELens's ``relu(pre) * (pre > threshold)``; with a ``bandwidth`` it is differentiable in the
  threshold through SAELens's straight-through estimator (the rectangle kernel of that bandwidth), as training needs;
- ``step``: the Heaviside ``pre > threshold`` with the same estimator (the JumpReLU L0 penalty);
- ``topk``: the ``k`` largest pre-activations of each row, ReLU'd, the rest zero;
- ``batch_topk``: the ``k * N`` largest ReLU'd pre-activations of the whole batch (``k`` per row on average).

circuit-tracer's JumpReLU ``pre * (pre > threshold)`` is the same rule for a threshold of at least zero, which its
file reader checks (``workbench.transcoders.files``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from jaxtyping import Float
from torch import Tensor


def relu(pre: Float[Tensor, "... X"]) -> Float[Tensor, "... X"]:
    """``max(pre, 0)``.

    Example:
        >>> relu(torch.tensor([-1.0, 2.0]))
        tensor([0., 2.])
    """
    return torch.relu(pre)


def rectangle(x: Tensor) -> Tensor:
    """SAELens's straight-through kernel: 1 on (-1/2, 1/2), else 0.

    Example:
        >>> rectangle(torch.tensor([-0.6, 0.0, 0.4]))
        tensor([0., 1., 1.])
    """
    return ((x > -0.5) & (x < 0.5)).to(x)


class _JumpReLU(torch.autograd.Function):
    """``relu(x) * (x > threshold)``; the gradient for ``x`` where it passes, SAELens's pseudo-gradient for the
    threshold ``-(threshold / bandwidth) * rectangle((x - threshold) / bandwidth)``, summed over rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return torch.relu(x) * (x > threshold).to(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, threshold = ctx.saved_tensors
        kernel = rectangle((x - threshold) / ctx.bandwidth)
        return (x > threshold) * grad, (-(threshold / ctx.bandwidth) * kernel * grad).sum(0), None


class _Step(torch.autograd.Function):
    """``x > threshold`` with SAELens's pseudo-gradient for the threshold (none for ``x``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return (x > threshold).to(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None]:
        x, threshold = ctx.saved_tensors
        kernel = rectangle((x - threshold) / ctx.bandwidth)
        return None, (-(1.0 / ctx.bandwidth) * kernel * grad).sum(0), None


def jumprelu(pre: Float[Tensor, "... X"], threshold: Float[Tensor, "X"], bandwidth: Optional[float] = None,
             ) -> Float[Tensor, "... X"]:
    """SAELens's JumpReLU ``relu(pre) * (pre > threshold)``; with ``bandwidth`` (training) the threshold gets
    SAELens's straight-through gradient (``pre`` is then ``[N, X]``: the threshold's gradient sums over rows).

    Example:
        >>> jumprelu(torch.tensor([0.5, 2.0, -3.0]), torch.tensor([1.0, 1.0, -4.0]))
        tensor([0., 2., 0.])
        >>> threshold = torch.tensor([1.0], requires_grad=True)
        >>> jumprelu(torch.tensor([[1.01]]), threshold, bandwidth=0.05).sum().backward(); threshold.grad
        tensor([-20.])
    """
    if bandwidth is None:
        return torch.relu(pre) * (pre > threshold).to(pre.dtype)
    return _JumpReLU.apply(pre, threshold, bandwidth)


def step(pre: Float[Tensor, "N X"], threshold: Float[Tensor, "X"], bandwidth: float) -> Float[Tensor, "N X"]:
    """``pre > threshold`` as 0 / 1, with SAELens's straight-through gradient for the threshold (the L0 penalty).

    Example:
        >>> step(torch.tensor([[0.5, 2.0]]), torch.tensor([1.0, 1.0]), bandwidth=0.05)
        tensor([[0., 1.]])
    """
    return _Step.apply(pre, threshold, bandwidth)


def topk(pre: Float[Tensor, "... X"], k: int) -> Float[Tensor, "... X"]:
    """The ``k`` largest pre-activations of each row, ReLU'd; every other feature zero.

    Example:
        >>> topk(torch.tensor([[3.0, -1.0, 2.0, 0.5]]), 2)
        tensor([[3., 0., 2., 0.]])
    """
    values, indices = torch.topk(pre, k=k, dim=-1, sorted=False)
    return torch.zeros_like(pre).scatter(-1, indices, values.relu())


def batch_topk(pre: Float[Tensor, "N X"], k: float) -> Float[Tensor, "N X"]:
    """The ``int(k * N)`` largest ReLU'd pre-activations of the whole batch (``k`` per row on average), the rest zero.

    Example:
        >>> batch_topk(torch.tensor([[3.0, -1.0], [2.0, 0.5]]), 1)
        tensor([[3., 0.],
                [2., 0.]])
    """
    flat = pre.relu().flatten()
    top = flat.topk(int(k * pre.shape[0]), sorted=False)
    return torch.zeros_like(flat).scatter(-1, top.indices, top.values).reshape(pre.shape)
