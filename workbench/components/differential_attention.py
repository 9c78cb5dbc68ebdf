"""Differential attention (DiffLlama; Ye et al. 2024, "Differential Transformer"), built from ``(cfg, options)``.

Legend: B batch, P position, H n_heads, G n_key_value_heads, K d_head, S key position.

The layer has H query heads over G key/value heads, as ``Attention`` (same projections, RoPE, KV cache,
kernels). Query heads i and i + H/2 form differential head i: its output is

    (1 - lambda_init) * RMSNorm_2K((A_i - lambda * A_{i+H/2}) @ [V_j, V_{G/2+j}])

where A are the two softmax maps, [V_j, V_{G/2+j}] the pair of value heads (2K wide) of query head i's
group (j its group mod G/2), RMSNorm over the 2K values without a gain, lambda = exp(lambda_q1 . lambda_k1)
- exp(lambda_q2 . lambda_k2) + lambda_init (``differential_lambda_init``, one value per layer).

Hooks: ``hook_pattern`` [B, H, P, S] holds every query head's softmax map (transformers' attention
weights); ``hook_pattern_1`` / ``hook_pattern_2`` [B, H/2, P, S] are each differential head's first and
second map (query heads i and i + H/2), editable apart; ``hook_z`` [B, P, H, K] is the normed differential
output, differential head i's 2K values as query heads 2i and 2i+1, so ``W_O`` [H, K, D] and ``hook_result``
keep their shapes (o_proj reads that flat vector).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workbench.components.attention import Attention
from workbench.config import ModelConfig
from workbench.errors import InputError
from workbench.hook_point import HookPoint
from workbench.options import RuntimeOptions


class DifferentialAttention(Attention):
    """``Attention`` whose heads pair up into differential heads (``cfg.differential_lambda_init`` set)."""

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__(cfg, options)
        K = cfg.d_head
        self.lambda_init, self.norm_eps = cfg.differential_lambda_init, cfg.norm_eps
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.zeros(K, dtype=options.dtype)))
        self.hook_pattern_1 = HookPoint()  # [B, H/2, P, S]
        self.hook_pattern_2 = HookPoint()  # [B, H/2, P, S]

    def attend(self, q_BHPK: Tensor, k_BGSK: Tensor, v_BGSK: Tensor, key_mask_BS: Optional[Tensor]) -> Tensor:
        """z [B, P, H, K]: the normed differential output of each head pair (see the module docstring)."""
        B, H, P, K = q_BHPK.shape
        G = v_BGSK.shape[1]
        if G != self.n_key_value_heads:
            raise InputError("ungroup_grouped_query_attention is not supported with differential attention: its "
                             "value heads pair up by key/value group")
        pairs_BgS2K = torch.cat([v_BGSK[:, : G // 2], v_BGSK[:, G // 2:]], dim=-1)
        z_BPH2K = super().attend(q_BHPK, k_BGSK, pairs_BgS2K.repeat(1, 2, 1, 1), key_mask_BS)
        z_BPh2K = z_BPH2K[:, :, : H // 2] - self.lambda_full().to(z_BPH2K.dtype) * z_BPH2K[:, :, H // 2:]
        normed_BPh2K = F.rms_norm(z_BPh2K, (2 * K,), eps=self.norm_eps) * (1 - self.lambda_init)
        return normed_BPh2K.reshape(B, P, H, K)

    def lambda_full(self) -> Tensor:
        """lambda: exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init (float32 sums, as transformers).

        Example:
            >>> attn = DifferentialAttention(ModelConfig(n_layers=1, d_model=8, n_heads=2, n_key_value_heads=2,
            ...                              d_vocab=10, n_ctx=4, positional="rotary", differential_lambda_init=0.2),
            ...                              RuntimeOptions())
            >>> round(attn.lambda_full().item(), 4)   # zero lambda vectors: exp(0) - exp(0) + 0.2
            0.2
        """
        first = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dtype=torch.float32))
        second = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dtype=torch.float32))
        return first - second + self.lambda_init

    def pattern_hook(self, pattern_BHPS: Tensor) -> Tensor:
        """``hook_pattern``, then each differential head's two maps through ``hook_pattern_1`` / ``hook_pattern_2``."""
        pattern_BHPS = self.hook_pattern(pattern_BHPS)
        half = pattern_BHPS.shape[1] // 2
        return torch.cat([self.hook_pattern_1(pattern_BHPS[:, :half]), self.hook_pattern_2(pattern_BHPS[:, half:])], dim=1)
