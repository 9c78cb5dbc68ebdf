"""The swappable inner attention functions: eager, sdpa and flash (tiled online softmax).

Legend: B batch, H query heads, G key/value heads (groups), g = H // G query heads per group,
Q query positions, S key positions, D d_head.

Every kernel takes q [B, H, Q, D], k and v [B, G, S, D] and a ``MaskSpec`` and returns
z [B, Q, H, D] (position-major, the layout of ``hook_z``). Grouped-query attention is done by
folding the g query heads of a group into the query axis ([B, G, g*Q, D]) so one matmul
against the group's single K/V head serves them all: K and V are never copied per query head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor


@dataclass(frozen=True)
class MaskSpec:
    """Which keys each query sees, and the additive position bias.

    Queries sit at absolute positions ``q_offset .. q_offset + Q - 1`` (non-zero while decoding
    with a KV cache); keys at ``0 .. S - 1``. Query i sees key j iff j <= i and, with a sliding
    window w, i - j < w. ALiBi adds -slope_h * (i - j).
    """

    scale: float
    q_offset: int = 0
    sliding_window: Optional[int] = None
    alibi_slopes_H: Optional[Tensor] = None

    @property
    def is_plain_causal(self) -> bool:
        """True when a bottom-right-aligned causal mask is all there is."""
        return self.sliding_window is None and self.alibi_slopes_H is None

    def bias(self, q_start: int, q_len: int, k_start: int, k_len: int, device: torch.device) -> Tensor:
        """Additive bias [1 or H, q_len, k_len] in float32: 0 where visible, -inf where masked."""
        i = torch.arange(q_start + self.q_offset, q_start + self.q_offset + q_len, device=device)[:, None]
        j = torch.arange(k_start, k_start + k_len, device=device)[None, :]
        visible = j <= i
        if self.sliding_window is not None:
            visible &= (i - j) < self.sliding_window
        bias = torch.zeros(q_len, k_len, device=device).masked_fill(~visible, float("-inf"))[None]
        if self.alibi_slopes_H is not None:
            bias = bias - self.alibi_slopes_H.to(device)[:, None, None] * (i - j).float()[None]
        return bias

    def key_range(self, q_start: int, q_end: int, n_keys: int) -> tuple[int, int]:
        """Keys [lo, hi) that any query in [q_start, q_end) can see: tiles outside are skipped."""
        hi = min(n_keys, q_end + self.q_offset)
        lo = 0 if self.sliding_window is None else max(0, q_start + self.q_offset - self.sliding_window + 1)
        return lo, hi


Hook = Callable[[Tensor], Tensor]


def _group_queries(q_BHQD: Tensor, n_kv: int) -> Tensor:
    """[B, H, Q, D] -> [B, G, g*Q, D]: the query heads of one K/V group side by side."""
    B, H, Q, D = q_BHQD.shape
    return q_BHQD.reshape(B, n_kv, (H // n_kv) * Q, D)


def eager_attention(
    q_BHQD: Float[Tensor, "batch n_heads q_pos d_head"],
    k_BGSD: Float[Tensor, "batch n_kv k_pos d_head"],
    v_BGSD: Float[Tensor, "batch n_kv k_pos d_head"],
    mask: MaskSpec,
    hook_scores: Hook = lambda t: t,
    hook_pattern: Hook = lambda t: t,
) -> Float[Tensor, "batch q_pos n_heads d_head"]:
    """Materialises scores and pattern so hooks can read and edit them."""
    B, H, Q, D = q_BHQD.shape
    G, S = k_BGSD.shape[1], k_BGSD.shape[2]
    scores_BGxS = _group_queries(q_BHQD, G) @ k_BGSD.transpose(-1, -2)
    scores_BHQS = scores_BGxS.view(B, H, Q, S) * mask.scale
    scores_BHQS = hook_scores(scores_BHQS + mask.bias(0, Q, 0, S, q_BHQD.device).to(scores_BHQS.dtype))
    pattern_BHQS = hook_pattern(torch.softmax(scores_BHQS.float(), dim=-1).to(q_BHQD.dtype))
    z_BGxD = pattern_BHQS.reshape(B, G, (H // G) * Q, S) @ v_BGSD
    return z_BGxD.view(B, H, Q, D).transpose(1, 2)


def sdpa_attention(
    q_BHQD: Float[Tensor, "batch n_heads q_pos d_head"],
    k_BGSD: Float[Tensor, "batch n_kv k_pos d_head"],
    v_BGSD: Float[Tensor, "batch n_kv k_pos d_head"],
    mask: MaskSpec,
) -> Float[Tensor, "batch q_pos n_heads d_head"]:
    """`torch.nn.functional.scaled_dot_product_attention`, GQA handled by torch (enable_gqa)."""
    Q, S = q_BHQD.shape[2], k_BGSD.shape[2]
    if mask.is_plain_causal and Q == S:
        attn_mask, is_causal = None, True
    elif mask.is_plain_causal and Q == 1:
        attn_mask, is_causal = None, False  # one new token sees the whole cache
    else:
        attn_mask, is_causal = mask.bias(0, Q, 0, S, q_BHQD.device).to(q_BHQD.dtype), False
    z = F.scaled_dot_product_attention(
        q_BHQD, k_BGSD, v_BGSD, attn_mask=attn_mask, is_causal=is_causal, scale=mask.scale,
        enable_gqa=k_BGSD.shape[1] != q_BHQD.shape[1],
    )
    return z.transpose(1, 2)


def tiled_flash_attention(
    q_BHQD: Float[Tensor, "batch n_heads q_pos d_head"],
    k_BGSD: Float[Tensor, "batch n_kv k_pos d_head"],
    v_BGSD: Float[Tensor, "batch n_kv k_pos d_head"],
    mask: MaskSpec,
    block_q: int = 256,
    block_k: int = 256,
) -> Float[Tensor, "batch q_pos n_heads d_head"]:
    """The FlashAttention algorithm in torch ops (the CPU path of ``attn_impl="flash"``).

    Queries are processed in tiles of ``block_q`` against key tiles of ``block_k`` with a running
    max ``m`` and running sum ``l`` (online softmax), so at most [B, H, block_q, block_k] scores
    exist at once, never [Q, S]. Key tiles that the causal mask or sliding window hides
    entirely are skipped.
    """
    B, H, Q, D = q_BHQD.shape
    G, S = k_BGSD.shape[1], k_BGSD.shape[2]
    g = H // G
    q_BGgQD = q_BHQD.view(B, G, g, Q, D)
    out_BGgQD = torch.empty(B, G, g, Q, D, dtype=q_BHQD.dtype, device=q_BHQD.device)
    for q_start in range(0, Q, block_q):
        q_end = min(q_start + block_q, Q)
        n_q = q_end - q_start
        q_tile = q_BGgQD[:, :, :, q_start:q_end].reshape(B, G, g * n_q, D).float() * mask.scale
        m = torch.full((B, G, g * n_q, 1), float("-inf"), device=q_BHQD.device)
        l = torch.zeros(B, G, g * n_q, 1, device=q_BHQD.device)
        acc = torch.zeros(B, G, g * n_q, D, device=q_BHQD.device)
        lo, hi = mask.key_range(q_start, q_end, S)
        for k_start in range(lo, hi, block_k):
            k_end = min(k_start + block_k, hi)
            s = q_tile @ k_BGSD[:, :, k_start:k_end].float().transpose(-1, -2)  # [B, G, g*n_q, n_k]
            bias = mask.bias(q_start, n_q, k_start, k_end - k_start, q_BHQD.device)  # [1|H, n_q, n_k]
            bias = bias.view(1, G, g, n_q, -1) if bias.shape[0] > 1 else bias.view(1, 1, 1, n_q, -1)
            s = (s.view(B, G, g, n_q, -1) + bias).view(B, G, g * n_q, -1)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with nothing visible yet
            p = torch.exp(s - m_safe)
            correction = torch.exp(m - m_safe)
            l = l * correction + p.sum(-1, keepdim=True)
            acc = acc * correction + p @ v_BGSD[:, :, k_start:k_end].float()
            m = m_new
        out_BGgQD[:, :, :, q_start:q_end] = (acc / l).view(B, G, g, n_q, D).to(q_BHQD.dtype)
    return out_BGgQD.view(B, H, Q, D).transpose(1, 2)


def flash_attention(
    q_BHQD: Float[Tensor, "batch n_heads q_pos d_head"],
    k_BGSD: Float[Tensor, "batch n_kv k_pos d_head"],
    v_BGSD: Float[Tensor, "batch n_kv k_pos d_head"],
    mask: MaskSpec,
) -> Float[Tensor, "batch q_pos n_heads d_head"]:
    """``attn_impl="flash"``: the Triton kernel on CUDA where it applies, else the tiled torch path."""
    if q_BHQD.is_cuda and mask.alibi_slopes_H is None and mask.q_offset == 0 and q_BHQD.shape[2] == k_BGSD.shape[2]:
        from workbench.kernels import triton_available, triton_flash_attention

        if triton_available():
            z = triton_flash_attention(q_BHQD, k_BGSD, v_BGSD, causal=True,
                                       sliding_window=mask.sliding_window, scale=mask.scale)
            return z.transpose(1, 2)
    return tiled_flash_attention(q_BHQD, k_BGSD, v_BGSD, mask)


FAST_KERNELS = {"sdpa": sdpa_attention, "flash": flash_attention}
