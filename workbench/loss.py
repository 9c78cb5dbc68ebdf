"""Next-token cross-entropy, from logits or straight from the final residual stream.

Legend: B batch, P position, D d_model, V d_vocab, N flattened tokens.

``Decoder.loss_fn`` and ``Decoder.loss_from_resid`` are the public entry points; this module is
their one implementation.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from workbench.errors import InputError
from workbench.components.embedding import soft_capped

# loss_from_resid makes logits one tile at a time: 2048 positions x 1024 vocabulary entries (8 MB
# of float32) stay in a small CPU's caches, where a full-vocabulary row block ran the unembedding
# GEMM ~1.25x slower.
TILE_POSITIONS, TILE_VOCAB = 2048, 1024


def next_token_loss(
    logits_BPV: Float[Tensor, "batch pos d_vocab"], tokens_BP: Int[Tensor, "batch pos"], per_token: bool = False,
    attention_mask: Optional[Tensor] = None,
) -> Tensor:
    """Cross-entropy of predicting token p+1 from position p: the mean, or [batch, pos - 1] with ``per_token``.

    With ``attention_mask`` [batch, pos] (1 = real token) only pairs of two real tokens count: the
    mean is over them, and the other entries of the per-token loss are 0.

    Example:
        >>> logits = torch.zeros(1, 3, 4)                     # uniform over 4 tokens
        >>> round(next_token_loss(logits, torch.tensor([[0, 1, 2]])).item(), 4)   # ln 4
        1.3863
    """
    if tokens_BP.shape[1] < 2:
        raise InputError("the loss needs at least two tokens (it predicts each next one)")
    losses = F.cross_entropy(logits_BPV[:, :-1].flatten(0, 1).float(), tokens_BP[:, 1:].flatten(), reduction="none")
    losses = losses.view(tokens_BP.shape[0], -1)
    if attention_mask is None:
        return losses if per_token else losses.mean()
    counted = (attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()).to(losses.device)
    if not bool(counted.any()):
        raise InputError("the attention mask leaves no pair of consecutive real tokens to score")
    losses = losses.masked_fill(~counted, 0.0)
    return losses if per_token else losses.sum() / counted.sum()


def token_losses_from_normed(
    normed_BPD: Float[Tensor, "batch pos d_model"], W_U_VD: Float[Tensor, "d_vocab d_model"],
    targets_BP: Int[Tensor, "batch pos"], b_U_V: Optional[Float[Tensor, "d_vocab"]] = None,
    soft_cap: Optional[float] = None,
) -> Float[Tensor, "batch pos"]:
    """-log softmax(normed @ W_U^T + b_U)[target] at every position, one cache-sized logits tile at a time
    (the logits soft-capped first when ``soft_cap`` is given, as ``Unembed`` does).

    Equal to ``F.cross_entropy`` of the full logits (within float rounding) without ever holding
    a [positions, d_vocab] block (see ``_row_losses``).

    Example:
        >>> normed, W_U = torch.zeros(1, 2, 3), torch.zeros(5, 3)      # uniform over 5 tokens
        >>> token_losses_from_normed(normed, W_U, torch.tensor([[0, 4]])).tolist()   # ln 5 each
        [[1.6094379425048828, 1.6094379425048828]]
    """
    normed_ND = normed_BPD.reshape(-1, normed_BPD.shape[-1])
    targets_N = targets_BP.reshape(-1).to(normed_ND.device)
    losses_N = torch.empty(len(targets_N), device=normed_ND.device)
    for row in range(0, len(targets_N), TILE_POSITIONS):
        rows = slice(row, row + TILE_POSITIONS)
        losses_N[rows] = _row_losses(normed_ND[rows], W_U_VD, targets_N[rows], b_U_V, soft_cap)
    return losses_N.view(targets_BP.shape)


def _row_losses(x_ND: Tensor, W_U_VD: Tensor, targets_N: Tensor, b_U_V: Optional[Tensor],
                soft_cap: Optional[float]) -> Float[Tensor, "N"]:
    """The losses of up to TILE_POSITIONS rows: log-sum-exp over the vocabulary tiles minus the target logit.

    The first tile's log-sum-exp is each row's shift; every later tile adds sum(exp(logits - shift)) in
    place, the shift folded into the GEMM where the logits are plain float32: one pass over a tile after its
    GEMM instead of logsumexp's three (SmolLM2's loss over 2048 rows took 0.92x the time, in-process A/B). A
    row whose later logits exceed its shift by ~80 (the sum would overflow) is redone with a per-tile maximum.
    """
    def logits(cols: slice) -> Tensor:  # as Unembed makes them, soft cap included, in float32
        bias = None if b_U_V is None else b_U_V[cols]
        return soft_capped(F.linear(x_ND, W_U_VD[cols], bias), soft_cap).float()

    shift_N1 = torch.logsumexp(logits(slice(0, TILE_VOCAB)), -1, keepdim=True)
    total_N1 = torch.ones_like(shift_N1)  # the first tile's sum(exp(logits - its log-sum-exp))
    fold_shift = b_U_V is None and soft_cap is None and x_ND.dtype == torch.float32
    minus_shift_N1 = -shift_N1
    reuse = fold_shift and not torch.is_grad_enabled()  # out= takes no part in autograd
    tile_NT = torch.empty(len(x_ND), TILE_VOCAB, device=x_ND.device) if reuse else None
    for col in range(TILE_VOCAB, W_U_VD.shape[0], TILE_VOCAB):
        cols = slice(col, col + TILE_VOCAB)
        if fold_shift:
            W_TD = W_U_VD[cols]
            out = tile_NT if tile_NT is not None and len(W_TD) == TILE_VOCAB else None  # a ragged last tile: its own
            shifted = torch.addmm(minus_shift_N1, x_ND, W_TD.T, out=out)
        else:
            shifted = logits(cols).sub_(shift_N1)
        total_N1 += shifted.exp_().sum(-1, keepdim=True)
    lse_N = (shift_N1 + total_N1.log()).squeeze(1)
    overflowed_N = ~torch.isfinite(total_N1.squeeze(1))
    if bool(overflowed_N.any()):
        tiles = range(0, W_U_VD.shape[0], TILE_VOCAB)
        lse_N[overflowed_N] = torch.stack([torch.logsumexp(logits(slice(col, col + TILE_VOCAB))[overflowed_N], -1)
                                           for col in tiles], -1).logsumexp(-1)
    # The target logit as the GEMM makes it: float32 dot products, rounded to the model's dtype, soft-capped.
    target_N = torch.einsum("nd,nd->n", x_ND.float(), W_U_VD[targets_N].float())
    if b_U_V is not None:
        target_N = target_N + b_U_V[targets_N].float()
    return lse_N - soft_capped(target_N.to(x_ND.dtype), soft_cap).float()
