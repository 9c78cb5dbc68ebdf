"""The swappable inner attention functions: eager, sdpa and flash (tiled online softmax).

Legend: B batch, H n_heads, G n_key_value_heads, g query heads per key/value head, P position,
S key position, K d_head.

Every kernel takes q [B, H, P, K], k and v [B, G, S, K] and a ``MaskSpec`` and returns
z [B, P, H, K] (position-major, the layout of ``hook_z``). Grouped-query attention is done by
folding the g query heads of a group into the query axis ([B, G, g*P, K]) so one matmul
against the group's single K/V head serves them all: K and V are never copied per query head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor


@dataclass(frozen=True)
class MaskSpec:
    """Which keys each query sees, and the additive position bias.

    Queries sit at absolute positions ``q_offset .. q_offset + P - 1`` (non-zero while decoding
    with a KV cache); keys at ``0 .. S - 1``. Query i sees key j iff j <= i and, with a sliding
    window w, i - j < w. ALiBi adds -slope_h * (i - j). With ``soft_cap`` c the scaled scores
    become c * tanh(scores / c) before the mask and bias are added (Gemma 2).

    ``key_mask_BS`` (True = a real token, False = padding; over every key position, cached ones
    included) hides padding keys from every query. A padding query, which then might see nothing,
    sees itself only, so no row of a pattern is empty (no NaN) and no real token ever reads a pad.
    """

    scale: float
    q_offset: int = 0
    sliding_window: Optional[int] = None
    alibi_slopes_H: Optional[Tensor] = None
    soft_cap: Optional[float] = None
    key_mask_BS: Optional[Tensor] = None

    @property
    def is_plain_causal(self) -> bool:
        """True when a bottom-right-aligned causal mask is all there is."""
        return self.sliding_window is None and self.alibi_slopes_H is None and self.key_mask_BS is None

    def capped(self, scaled_scores: Tensor) -> Tensor:
        """Soft-capping of scaled scores (identity without ``soft_cap``)."""
        if self.soft_cap is None:
            return scaled_scores
        return torch.tanh(scaled_scores / self.soft_cap) * self.soft_cap

    def bias(self, q_start: int, q_len: int, k_start: int, k_len: int, device: torch.device) -> Tensor:
        """Additive bias [1 or B, 1 or H, q_len, k_len] in float32: 0 where visible, -inf where masked."""
        i = torch.arange(q_start + self.q_offset, q_start + self.q_offset + q_len, device=device)[:, None]
        j = torch.arange(k_start, k_start + k_len, device=device)[None, :]
        visible = (j <= i)[None]  # [1, q, k]
        if self.sliding_window is not None:
            visible = visible & ((i - j) < self.sliding_window)
        if self.key_mask_BS is not None:
            key_mask = self.key_mask_BS.to(device)
            query_is_pad_Bq = ~key_mask[:, q_start + self.q_offset:q_start + self.q_offset + q_len]
            visible = (visible & key_mask[:, None, k_start:k_start + k_len]) | (query_is_pad_Bq[:, :, None] & (i == j))
        bias = torch.zeros(visible.shape, device=device).masked_fill(~visible, float("-inf"))[:, None]
        if self.alibi_slopes_H is not None:
            bias = bias - self.alibi_slopes_H.to(device)[None, :, None, None] * (i - j).float()
        return bias

    def key_range(self, q_start: int, q_end: int, n_keys: int) -> tuple[int, int]:
        """Keys [lo, hi) that any query in [q_start, q_end) can see: tiles outside are skipped."""
        hi = min(n_keys, q_end + self.q_offset)
        lo = 0 if self.sliding_window is None else max(0, q_start + self.q_offset - self.sliding_window + 1)
        return lo, hi


Hook = Callable[[Tensor], Tensor]


def _group_queries(q_BHPK: Tensor, n_kv: int) -> Tensor:
    """[B, H, P, K] -> [B, G, g*P, K]: the query heads of one K/V group side by side."""
    B, H, P, K = q_BHPK.shape
    return q_BHPK.reshape(B, n_kv, (H // n_kv) * P, K)


def eager_attention(
    q_BHPK: Float[Tensor, "batch n_heads pos d_head"],
    k_BGSK: Float[Tensor, "batch n_key_value_heads key_pos d_head"],
    v_BGSK: Float[Tensor, "batch n_key_value_heads key_pos d_head"],
    mask: MaskSpec,
    hook_scores: Hook = lambda t: t,
    hook_pattern: Hook = lambda t: t,
) -> Float[Tensor, "batch pos n_heads d_head"]:
    """Materialises scores and pattern so hooks can read and edit them."""
    B, H, P, K = q_BHPK.shape
    G, S = k_BGSK.shape[1], k_BGSK.shape[2]
    scores_BGxS = _group_queries(q_BHPK, G) @ k_BGSK.transpose(-1, -2)
    scores_BHPS = mask.capped(scores_BGxS.view(B, H, P, S) * mask.scale)
    scores_BHPS = hook_scores(scores_BHPS + mask.bias(0, P, 0, S, q_BHPK.device).to(scores_BHPS.dtype))
    pattern_BHPS = hook_pattern(torch.softmax(scores_BHPS.float(), dim=-1).to(q_BHPK.dtype))
    z_BGxK = pattern_BHPS.reshape(B, G, (H // G) * P, S) @ v_BGSK
    return z_BGxK.view(B, H, P, K).transpose(1, 2)


def sdpa_attention(
    q_BHPK: Float[Tensor, "batch n_heads pos d_head"],
    k_BGSK: Float[Tensor, "batch n_key_value_heads key_pos d_head"],
    v_BGSK: Float[Tensor, "batch n_key_value_heads key_pos d_head"],
    mask: MaskSpec,
) -> Float[Tensor, "batch pos n_heads d_head"]:
    """`torch.nn.functional.scaled_dot_product_attention`, GQA handled by torch (enable_gqa).

    SDPA has no soft-capping, so a capped layer runs the eager computation (without hooks)."""
    if mask.soft_cap is not None:
        return eager_attention(q_BHPK, k_BGSK, v_BGSK, mask)
    P, S = q_BHPK.shape[2], k_BGSK.shape[2]
    if mask.is_plain_causal and P == S:
        attn_mask, is_causal = None, True
    elif mask.is_plain_causal and P == 1:
        attn_mask, is_causal = None, False  # one new token sees the whole cache
    else:
        attn_mask, is_causal = mask.bias(0, P, 0, S, q_BHPK.device).to(q_BHPK.dtype), False
    z = F.scaled_dot_product_attention(
        q_BHPK, k_BGSK, v_BGSK, attn_mask=attn_mask, is_causal=is_causal, scale=mask.scale,
        enable_gqa=k_BGSK.shape[1] != q_BHPK.shape[1],
    )
    return z.transpose(1, 2)


def tiled_flash_attention(
    q_BHPK: Float[Tensor, "batch n_heads pos d_head"],
    k_BGSK: Float[Tensor, "batch n_key_value_heads key_pos d_head"],
    v_BGSK: Float[Tensor, "batch n_key_value_heads key_pos d_head"],
    mask: MaskSpec,
    block_q: int = 256,
    block_k: int = 256,
) -> Float[Tensor, "batch pos n_heads d_head"]:
    """The FlashAttention algorithm in torch ops (the CPU path of ``attn_impl="flash"``).

    Queries are processed in tiles of ``block_q`` against key tiles of ``block_k`` with a running
    max ``m`` and running sum ``l`` (online softmax), so at most [B, H, block_q, block_k] scores
    exist at once, never [P, S]. Key tiles that the causal mask or sliding window hides
    entirely are skipped.
    """
    B, H, P, K = q_BHPK.shape
    G, S = k_BGSK.shape[1], k_BGSK.shape[2]
    g = H // G
    q_BGgPK = q_BHPK.view(B, G, g, P, K)
    out_BGgPK = torch.empty(B, G, g, P, K, dtype=q_BHPK.dtype, device=q_BHPK.device)
    for q_start in range(0, P, block_q):
        q_end = min(q_start + block_q, P)
        n_q = q_end - q_start
        q_tile = q_BGgPK[:, :, :, q_start:q_end].reshape(B, G, g * n_q, K).float() * mask.scale
        m = torch.full((B, G, g * n_q, 1), float("-inf"), device=q_BHPK.device)
        l = torch.zeros(B, G, g * n_q, 1, device=q_BHPK.device)
        acc = torch.zeros(B, G, g * n_q, K, device=q_BHPK.device)
        lo, hi = mask.key_range(q_start, q_end, S)
        for k_start in range(lo, hi, block_k):
            k_end = min(k_start + block_k, hi)
            s = mask.capped(q_tile @ k_BGSK[:, :, k_start:k_end].float().transpose(-1, -2))  # [B, G, g*n_q, n_k]
            bias = mask.bias(q_start, n_q, k_start, k_end - k_start, q_BHPK.device)  # [1|B, 1|H, n_q, n_k]
            heads = (G, g) if bias.shape[1] > 1 else (1, 1)
            bias = bias.view(bias.shape[0], *heads, n_q, -1)
            s = (s.view(B, G, g, n_q, -1) + bias).view(B, G, g * n_q, -1)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with nothing visible yet
            p = torch.exp(s - m_safe)
            correction = torch.exp(m - m_safe)
            l = l * correction + p.sum(-1, keepdim=True)
            acc = acc * correction + p @ v_BGSK[:, :, k_start:k_end].float()
            m = m_new
        out_BGgPK[:, :, :, q_start:q_end] = (acc / l).view(B, G, g, n_q, K).to(q_BHPK.dtype)
    return out_BGgPK.view(B, H, P, K).transpose(1, 2)


def flash_attention(
    q_BHPK: Float[Tensor, "batch n_heads pos d_head"],
    k_BGSK: Float[Tensor, "batch n_key_value_heads key_pos d_head"],
    v_BGSK: Float[Tensor, "batch n_key_value_heads key_pos d_head"],
    mask: MaskSpec,
) -> Float[Tensor, "batch pos n_heads d_head"]:
    """``attn_impl="flash"``: the Triton kernel on CUDA where it applies, else the tiled torch path."""
    if (q_BHPK.is_cuda and mask.alibi_slopes_H is None and mask.soft_cap is None and mask.key_mask_BS is None
            and mask.q_offset == 0
            and q_BHPK.shape[2] == k_BGSK.shape[2]):
        from workbench.kernels import triton_available, triton_flash_attention

        if triton_available():
            z = triton_flash_attention(q_BHPK, k_BGSK, v_BGSK, causal=True,
                                       sliding_window=mask.sliding_window, scale=mask.scale)
            return z.transpose(1, 2)
    return tiled_flash_attention(q_BHPK, k_BGSK, v_BGSK, mask)


FAST_KERNELS = {"sdpa": sdpa_attention, "flash": flash_attention}
