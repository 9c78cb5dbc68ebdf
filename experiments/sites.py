"""Where an experiment writes into a run: a ``Site`` is a slice of one hook point's activation.

Legend: B batch, P position, H n_heads, K d_head, M d_mlp, D d_model.

Ablation writes zeros, a mean or another prompt's activation into a site; patching writes the
clean run's activation into a site of the corrupted run. Both go through ``Site.write``, the one
implementation of "replace this slice". A site is the whole activation, one position of it, one
index of the axis after position (a head of ``attn.hook_z`` [B, P, H, K], a neuron of
``mlp.hook_post`` [B, P, M]), or one index at one position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import Tensor


@dataclass(frozen=True)
class Site:
    """A slice of the activation at ``hook_name``: every position or one, every index or one.

    Example:
        >>> import torch
        >>> z = torch.ones(1, 2, 3, 1)                       # [B, P, H, K]
        >>> Site("blocks.0.attn.hook_z", index=1).write(z)[0, :, :, 0].tolist()
        [[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]]
    """

    hook_name: str
    position: Optional[int] = None
    index: Optional[int] = None  # on the axis after position: the head, or the neuron

    def write(self, activation: Tensor, value: Optional[Tensor] = None) -> Tensor:
        """``activation`` with this slice set to ``value``'s same slice (zeros when None); written in place.

        ``value`` is [B or 1, P' >= P, ...]: a batch of one broadcasts over the rows, and only its
        leading P positions are read (a batched sweep may leave out the last position).

        Example:
            >>> import torch
            >>> resid = torch.zeros(1, 3, 2)
            >>> Site("blocks.0.hook_resid_pre", position=1).write(resid, torch.ones(1, 3, 2))[0].tolist()
            [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
        """
        where = (slice(None), slice(None) if self.position is None else self.position)
        if self.index is not None:
            where += (self.index,)
        activation[where] = 0 if value is None else value[:, :activation.shape[1]][where]
        return activation
