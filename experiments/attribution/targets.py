"""The logit nodes: the most probable next tokens, circuit-tracer's "salient logits" rule.

The smallest set of top tokens whose probabilities add up to ``desired_logit_prob``, at most ``max_n_logits``;
each is read along its unembedding column minus the mean column (so a logit node is the token's logit relative to
the average logit, which the softmax cannot tell apart from the logit itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor


@dataclass
class LogitTargets:
    """The chosen tokens, their probabilities and their read directions ``[k, d_model]``."""

    token_ids: Int[Tensor, "logit"]
    probabilities: Float[Tensor, "logit"]
    vectors: Float[Tensor, "logit d_model"]


def salient_logits(logits: Float[Tensor, "d_vocab"], W_U: Float[Tensor, "d_model d_vocab"], max_n_logits: int,
                   desired_logit_prob: float) -> LogitTargets:
    """The top tokens up to ``desired_logit_prob`` of probability, at most ``max_n_logits``.

    Example:
        >>> t = salient_logits(torch.tensor([2.0, 1.0, 0.0, -5.0]), torch.eye(4), max_n_logits=3, desired_logit_prob=0.7)
        >>> t.token_ids.tolist(), [round(p, 3) for p in t.probabilities.tolist()]
        ([0, 1], [0.665, 0.245])
    """
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_idx = torch.topk(probs, min(max_n_logits, probs.shape[0]))
    cutoff = int(torch.searchsorted(torch.cumsum(top_p, 0), desired_logit_prob)) + 1
    ids = top_idx[:cutoff]
    return LogitTargets(token_ids=ids, probabilities=probs[ids], vectors=logit_directions(W_U, ids))


def logit_directions(W_U: Float[Tensor, "d_model d_vocab"], token_ids: Int[Tensor, "logit"]) -> Float[Tensor, "logit d_model"]:
    """Where the logit nodes of ``token_ids`` read: each unembedding column minus the mean column.

    Example:
        >>> logit_directions(torch.tensor([[1.0, 3.0]]), torch.tensor([1]))
        tensor([[1.]])
    """
    W_U = W_U.detach().float()
    return W_U[:, token_ids].T - W_U.mean(dim=1)
