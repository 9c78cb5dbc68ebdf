"""The behaviours circuits are found for: prompt pairs and their metric for the induction task (IOI pairs come
from ``experiments.datasets.ioi_dataset``).

Legend: B batch, P position, V d_vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from experiments.patching.pairs import PairedPrompts
from experiments.datasets import repeated_random_tokens
from experiments.metrics import CallableMetric, PromptBatch


@dataclass(frozen=True, eq=False)
class SecondCopyLogProb:
    """Each row's mean log-probability of the second copy's tokens (positions seq_len + 1 .. 2 seq_len predict them)."""

    seq_len: int

    def __call__(self, logits_BPV: Tensor, tokens_BP: Tensor) -> Tensor:
        C = self.seq_len
        log_probs = logits_BPV[:, C:2 * C].float().log_softmax(-1)
        return log_probs.gather(-1, tokens_BP[:, C + 1:2 * C + 1, None].to(log_probs.device))[..., 0].mean(1)


def induction_pairs(model, seq_len: int = 20, n: int = 16, seed: int = 0) -> PairedPrompts:
    """Repeated random tokens (a prefix, then seq_len tokens twice) against the same second copy after a different
    first copy, so only the clean run can predict it; the metric is the second copy's mean log-probability.

    Example:
        >>> pairs = induction_pairs(model, seq_len=5, n=2)
        >>> pairs.clean.tokens.shape, torch.equal(pairs.clean.tokens[:, 6:], pairs.corrupt.tokens[:, 6:])
        (torch.Size([2, 11]), True)
    """
    clean = repeated_random_tokens(model, seq_len, n, seed)
    other = repeated_random_tokens(model, seq_len, n, seed + 1)
    corrupt = clean.clone()
    corrupt[:, 1:seq_len + 1] = other[:, 1:seq_len + 1]
    return PairedPrompts(PromptBatch(clean), PromptBatch(corrupt), CallableMetric(SecondCopyLogProb(seq_len), "all"))
