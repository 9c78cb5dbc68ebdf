"""Abs-top-k (Zhu et al., ICLR 2026, arXiv 2510.00404; SAELens's ``AbsTopKSAE``): the ``k`` pre-activations of
largest magnitude in each row fire with their sign (no ReLU), so a feature can fire in either direction.

Legend: X d_sae.

Everything else is top-k's (SAELens's ``AbsTopKSAE`` subclasses ``TopKSAE``): ``k`` and
``rescale_acts_by_decoder_norm`` (the selection is on pre-activation times decoder norm, and the decode divides by
it again), ``W_enc``, ``b_enc``, ``W_dec``, ``b_dec``. Inference only: no training form yet.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from workbench.sae.architectures.base import rows
from workbench.sae.architectures.topk import TopK


def abs_topk(pre: Float[Tensor, "... X"], k: int) -> Float[Tensor, "... X"]:
    """The ``k`` entries of each row largest in magnitude, signed; the rest zero (SAELens's ``AbsTopK``).

    Example:
        >>> abs_topk(torch.tensor([[3.0, -5.0, 1.0]]), 2)
        tensor([[ 3., -5.,  0.]])
    """
    kept = pre.abs().topk(k, dim=-1, sorted=False).indices
    return torch.zeros_like(pre).scatter_(-1, kept, pre.gather(-1, kept))


class AbsTopK(TopK):
    """Top-k by magnitude, keeping the sign, chosen after the decoder-norm rescaling if any.

    Example (the negative pre-activation is the larger in magnitude and fires negative):
        >>> from types import SimpleNamespace
        >>> sae = SimpleNamespace(cfg=SimpleNamespace(k=1, rescale_acts_by_decoder_norm=False))
        >>> AbsTopK().activate(sae, torch.tensor([[3.0, -4.0]]))
        tensor([[ 0., -4.]])
    """

    activation = "abstopk"

    def activate(self, sae: nn.Module, hidden_pre: Float[Tensor, "... X"]) -> Float[Tensor, "... X"]:
        if sae.cfg.rescale_acts_by_decoder_norm:  # chosen by pre-activation times decoder norm, as top-k
            hidden_pre = hidden_pre * sae.W_dec.norm(dim=-1)
        return abs_topk(hidden_pre, sae.cfg.k)


SPECS = rows(AbsTopK(), "abstopk")
TRAINING = ()  # inference only
