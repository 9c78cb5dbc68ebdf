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
    a [positions, d_vocab] block: each tile gives its log-sum-exp and any target logits it holds.

    Example:
        >>> normed, W_U = torch.zeros(1, 2, 3), torch.zeros(5, 3)      # uniform over 5 tokens
        >>> token_losses_from_normed(normed, W_U, torch.tensor([[0, 4]])).tolist()   # ln 5 each
        [[1.6094379425048828, 1.6094379425048828]]
    """
    normed_ND = normed_BPD.reshape(-1, normed_BPD.shape[-1])
    targets_N = targets_BP.reshape(-1).to(normed_ND.device)
    losses_N = torch.empty(len(targets_N), device=normed_ND.device)
    for row in range(0, len(targets_N), TILE_POSITIONS):
        x_ND, targets = normed_ND[row:row + TILE_POSITIONS], targets_N[row:row + TILE_POSITIONS]
        target_logit = torch.empty(len(targets), device=normed_ND.device)
        tile_lse = []
        for col in range(0, W_U_VD.shape[0], TILE_VOCAB):
            bias = None if b_U_V is None else b_U_V[col:col + TILE_VOCAB]
            logits_NV = soft_capped(F.linear(x_ND, W_U_VD[col:col + TILE_VOCAB], bias), soft_cap).float()  # as the model's
            tile_lse.append(torch.logsumexp(logits_NV, -1))
            here = (targets >= col) & (targets < col + logits_NV.shape[1])
            target_logit[here] = logits_NV[here, targets[here] - col]
        losses_N[row:row + TILE_POSITIONS] = torch.logsumexp(torch.stack(tile_lse, -1), -1) - target_logit
    return losses_N.view(targets_BP.shape)
