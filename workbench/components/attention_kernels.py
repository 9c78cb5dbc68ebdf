"""The swappable inner attention functions: eager, sdpa and flash (tiled online softmax).

Legend: B batch, H n_heads, G n_key_value_heads, g query heads per key/value head, P position,
S key position, K d_head, J d_head_v.

J, the value width, is K except under latent attention.

Every kernel takes q [B, H, P, K], k [B, G, S, K], v [B, G, S, J] and a ``MaskSpec`` and returns
z [B, P, H, J] (position-major, the layout of ``hook_z``). Grouped-query attention is done by
folding the g query heads of a group into the query axis ([B, G, g*P, K]) so one matmul
against the group's single K/V head serves them all: K and V are never copied per query head.
"""

from __future__ import annotations

import functools
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

    ``sinks_H`` (gpt-oss): one logit per head that joins every query's softmax as an extra key with
    no value, so it takes probability mass without adding to z.

    ``chunk_size`` c (Llama 4's chunked attention): a query sees only keys of its own chunk, position // c
    (positions counted from each row's first real token when ``key_mask_BS`` marks padding).

    Example:
        >>> mask = MaskSpec(scale=1 / model.cfg.attn_scale)   # the toy model's: 1 / sqrt(d_head)
        >>> mask.is_plain_causal, MaskSpec(scale=1.0, sliding_window=4).is_plain_causal
        (True, False)
    """

    scale: float
    q_offset: int = 0
    sliding_window: Optional[int] = None
    alibi_slopes_H: Optional[Tensor] = None
    soft_cap: Optional[float] = None
    key_mask_BS: Optional[Tensor] = None
    sinks_H: Optional[Tensor] = None
    chunk_size: Optional[int] = None

    @property
    def is_plain_causal(self) -> bool:
        """True when a bottom-right-aligned causal mask is all there is.

        Example:
            >>> padding = torch.tensor([[False, True, True]])   # the first key is a pad
            >>> MaskSpec(1.0, q_offset=5).is_plain_causal, MaskSpec(1.0, key_mask_BS=padding).is_plain_causal
            (True, False)
        """
        return (self.sliding_window is None and self.alibi_slopes_H is None and self.key_mask_BS is None
                and self.sinks_H is None and self.chunk_size is None)

    def capped(self, scaled_scores: Tensor) -> Tensor:
        """Soft-capping of scaled scores (identity without ``soft_cap``).

        Example:
            >>> MaskSpec(scale=1.0, soft_cap=30.0).capped(torch.tensor([1.0, 100.0])).round(decimals=3)
            tensor([ 1.0000, 29.9240])
        """
        if self.soft_cap is None:
            return scaled_scores
        return torch.tanh(scaled_scores / self.soft_cap) * self.soft_cap

    def bias(self, q_start: int, q_len: int, k_start: int, k_len: int, device: torch.device) -> Tensor:
        """Additive bias [1 or B, 1 or H, q_len, k_len] in float32: 0 where visible, -inf where masked.

        Example:
            >>> MaskSpec(scale=1.0, sliding_window=2).bias(0, 3, 0, 3, torch.device("cpu"))[0, 0]
            tensor([[0., -inf, -inf],
                    [0., 0., -inf],
                    [-inf, 0., 0.]])
        """
        i = torch.arange(q_start + self.q_offset, q_start + self.q_offset + q_len, device=device)[:, None]
        j = torch.arange(k_start, k_start + k_len, device=device)[None, :]
        visible = (j <= i)[None]  # [1, q, k]
        if self.sliding_window is not None:
            visible = visible & ((i - j) < self.sliding_window)
        if self.chunk_size is not None:  # each row's positions count from its first real token
            if self.key_mask_BS is None:
                chunk_q, chunk_k = i // self.chunk_size, j // self.chunk_size
            else:
                positions_BS = self.key_mask_BS.to(device).long().cumsum(-1) - 1
                chunk_q = positions_BS[:, i[:, 0], None] // self.chunk_size  # [B, q, 1]
                chunk_k = positions_BS[:, None, j[0]] // self.chunk_size  # [B, 1, k]
            visible = visible & (chunk_q == chunk_k)
        if self.key_mask_BS is not None:
            key_mask = self.key_mask_BS.to(device)
            query_is_pad_Bq = ~key_mask[:, q_start + self.q_offset:q_start + self.q_offset + q_len]
            visible = (visible & key_mask[:, None, k_start:k_start + k_len]) | (query_is_pad_Bq[:, :, None] & (i == j))
        bias = torch.zeros(visible.shape, device=device).masked_fill(~visible, float("-inf"))[:, None]
        if self.alibi_slopes_H is not None:
            bias = bias - self.alibi_slopes_H.to(device)[None, :, None, None] * (i - j).float()
        return bias

    def grouped_bias(self, B: int, H: int, G: int, P: int, S: int, device: torch.device,
                     dtype: torch.dtype) -> Tensor:
        """The bias of all P queries against all S keys in eager attention's grouped layout: broadcastable
        to [B*G, g*P, S], each group's g query heads side by side. The plain causal one is built once per
        shape (it is the same for every layer of a forward pass) while it is small.

        Example:
            >>> MaskSpec(scale=1.0).grouped_bias(1, 4, 2, 2, 2, torch.device("cpu"), torch.float32)[0]
            tensor([[0., -inf],
                    [0., 0.],
                    [0., -inf],
                    [0., 0.]])
        """
        if self.alibi_slopes_H is None and self.key_mask_BS is None and (H // G) * P * S <= _CACHED_BIAS_MAX:
            return _grouped_window_bias(H // G, P, S, self.q_offset, self.sliding_window, device, dtype, self.chunk_size)
        bias_bhPS = self.bias(0, P, 0, S, device).to(dtype)
        return bias_bhPS.expand(B, H, P, S).reshape(B * G, (H // G) * P, S)

    def key_range(self, q_start: int, q_end: int, n_keys: int) -> tuple[int, int]:
        """Keys [lo, hi) that any query in [q_start, q_end) can see: tiles outside are skipped.

        Example:
            >>> MaskSpec(scale=1.0, sliding_window=4).key_range(8, 12, 16)   # query 8 sees keys 5..8, query 11 up to 11
            (5, 12)
        """
        hi = min(n_keys, q_end + self.q_offset)
        lo = 0 if self.sliding_window is None else max(0, q_start + self.q_offset - self.sliding_window + 1)
        return lo, hi


_CACHED_BIAS_MAX = 2**20  # elements (4 MiB in float32): larger biases are rebuilt per layer, not kept


@functools.lru_cache(maxsize=8)
def _grouped_window_bias(g: int, P: int, S: int, q_offset: int, sliding_window: Optional[int],
                         device: torch.device, dtype: torch.dtype, chunk_size: Optional[int] = None) -> Tensor:
    """[1, g*P, S]: the causal (and sliding-window or chunked) bias repeated for g query heads. Read only: cached."""
    bias_11PS = MaskSpec(scale=1.0, q_offset=q_offset, sliding_window=sliding_window,
                         chunk_size=chunk_size).bias(0, P, 0, S, device)
    return bias_11PS.to(dtype).expand(1, g, P, S).reshape(1, g * P, S)


Hook = Callable[[Tensor], Tensor]


def identity_hook(t: Tensor) -> Tensor:
    """A hook that leaves its tensor as it is (the default where no HookPoint is passed).

    Example:
        >>> identity_hook(tokens) is tokens
        True
    """
    return t


def eager_attention(
    q_BHPK: Float[Tensor, "batch n_heads pos d_head"],
    k_BGSK: Float[Tensor, "batch n_key_value_heads key_pos d_head"],
    v_BGSJ: Float[Tensor, "batch n_key_value_heads key_pos d_head_v"],
    mask: MaskSpec,
    hook_scores: Hook = identity_hook,
    hook_pattern: Hook = identity_hook,
    hook_sink_weight: Hook = identity_hook,
) -> Float[Tensor, "batch pos n_heads d_head_v"]:
    """Materialises scores and pattern so hooks can read and edit them. With sinks the pattern holds the
    real keys' weights (rows sum to less than one) and ``hook_sink_weight`` [B, H, P] the sinks' share.

    The B*G (batch, key/value head) pairs are one batch of matmuls (N below) whose rows are the group's
    g query heads side by side; scaling and the mask's bias are fused into the scores' matmul (baddbmm).

    Example:
        >>> q, k, v = (cache[f"blocks.0.attn.hook_{name}"].transpose(1, 2) for name in ("rot_q", "rot_k", "v"))
        >>> z = eager_attention(q, k, v, MaskSpec(scale=1 / model.cfg.attn_scale))   # [batch, pos, n_heads, d_head]
        >>> torch.equal(z, cache["blocks.0.attn.hook_z"])   # what the model computed (caching runs it eager)
        True
    """
    B, H, P, K = q_BHPK.shape
    G, S, J = k_BGSK.shape[1], k_BGSK.shape[2], v_BGSJ.shape[-1]
    N, gP = B * G, (H // G) * P
    q_NxK, k_NSK, v_NSJ = q_BHPK.reshape(N, gP, K), k_BGSK.reshape(N, S, K), v_BGSJ.reshape(N, S, J)
    bias_NxS = mask.grouped_bias(B, H, G, P, S, q_BHPK.device, q_BHPK.dtype)
    if mask.soft_cap is None:
        scores_NxS = torch.baddbmm(bias_NxS, q_NxK, k_NSK.transpose(1, 2), alpha=mask.scale)
    else:  # the cap applies to the scaled scores before the bias
        scores_NxS = mask.capped(torch.bmm(q_NxK, k_NSK.transpose(1, 2)).mul_(mask.scale)).add_(bias_NxS)
    scores_BHPS = hook_scores(scores_NxS.view(B, H, P, S))
    if mask.sinks_H is None:
        probs_BHPS = torch.softmax(scores_BHPS.float(), dim=-1)
    else:
        sinks_BHP1 = mask.sinks_H.float()[None, :, None, None].expand(B, H, P, 1)
        probs_BHPS1 = torch.softmax(torch.cat([scores_BHPS.float(), sinks_BHP1], dim=-1), dim=-1)
        probs_BHPS = probs_BHPS1[..., :S]
        hook_sink_weight(probs_BHPS1[..., S].to(q_BHPK.dtype))
    pattern_BHPS = hook_pattern(probs_BHPS.to(q_BHPK.dtype))
    z_NxJ = torch.bmm(pattern_BHPS.reshape(N, gP, S), v_NSJ)
    return z_NxJ.view(B, H, P, J).transpose(1, 2)


def sdpa_attention(
    q_BHPK: Float[Tensor, "batch n_heads pos d_head"],
    k_BGSK: Float[Tensor, "batch n_key_value_heads key_pos d_head"],
    v_BGSJ: Float[Tensor, "batch n_key_value_heads key_pos d_head_v"],
    mask: MaskSpec,
) -> Float[Tensor, "batch pos n_heads d_head_v"]:
    """`torch.nn.functional.scaled_dot_product_attention`, GQA handled by torch (enable_gqa).

    SDPA has no soft-capping, so a capped layer runs the eager computation (without hooks). Sinks
    become one more key whose vector and value are zero (score 0) with the sink logit as its bias.

    Example:
        >>> q, k, v = (cache[f"blocks.0.attn.hook_{name}"].transpose(1, 2) for name in ("rot_q", "rot_k", "v"))
        >>> z = sdpa_attention(q, k, v, MaskSpec(scale=1 / model.cfg.attn_scale))
        >>> torch.allclose(z, cache["blocks.0.attn.hook_z"], atol=1e-5)   # eager's z, up to rounding
        True
    """
    if mask.soft_cap is not None:
        return eager_attention(q_BHPK, k_BGSK, v_BGSJ, mask)
    B, H, P, S = *q_BHPK.shape[:3], k_BGSK.shape[2]
    if mask.is_plain_causal and P == S:
        attn_mask, is_causal = None, True
    elif mask.is_plain_causal and P == 1:
        attn_mask, is_causal = None, False  # one new token sees the whole cache
    else:
        attn_mask, is_causal = mask.bias(0, P, 0, S, q_BHPK.device).to(q_BHPK.dtype), False
    if mask.sinks_H is not None:
        sinks_BHP1 = mask.sinks_H.to(q_BHPK.dtype)[None, :, None, None].expand(B, H, P, 1)
        attn_mask = torch.cat([attn_mask.expand(B, H, P, S), sinks_BHP1], dim=-1)
        k_BGSK, v_BGSJ = (torch.cat([t, t.new_zeros(*t.shape[:2], 1, t.shape[-1])], dim=2) for t in (k_BGSK, v_BGSJ))
    z_BHPJ = F.scaled_dot_product_attention(
        q_BHPK, k_BGSK, v_BGSJ, attn_mask=attn_mask, is_causal=is_causal, scale=mask.scale,
        enable_gqa=k_BGSK.shape[1] != q_BHPK.shape[1],
    )
    return nan_where_query_nonfinite(q_BHPK, z_BHPJ).transpose(1, 2)


def nan_where_query_nonfinite(
    q_BHPK: Float[Tensor, "batch n_heads pos d_head"], z_BHPJ: Float[Tensor, "batch n_heads pos d_head_v"],
) -> Float[Tensor, "batch n_heads pos d_head_v"]:
    """``z`` with NaN in every (head, position) whose query holds a NaN or an infinity, as eager attention
    gives there (every score of that row is NaN or infinite, so its softmax is NaN). Fused kernels need not:
    torch's causal SDPA on the CPU returns zeros there, hiding the fault (applied to the Triton kernel too).

    One reduction over q and one add over z, no host sync (about 1% of causal SDPA's time at 512
    positions on the CPU): a query holding a NaN or an infinity has a non-finite sum, and that sum
    times zero is NaN (else 0). Summed in float32, so a finite half-precision query never overflows.

    Example:
        >>> q_BHPK, z_BHPJ = torch.ones(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)
        >>> q_BHPK[0, 1, 2, 0] = float("nan")
        >>> nan_where_query_nonfinite(q_BHPK, z_BHPJ).isnan().any(-1)   # head 1, position 2 only
        tensor([[[False, False, False],
                 [False, False,  True]]])
    """
    zero_or_nan_BHP1 = q_BHPK.sum(dim=-1, keepdim=True, dtype=torch.float32).mul_(0.0)
    return z_BHPJ + zero_or_nan_BHP1.to(z_BHPJ.dtype)  # out of place: SDPA's backward keeps its output


def tiled_flash_attention(
    q_BHPK: Float[Tensor, "batch n_heads pos d_head"],
    k_BGSK: Float[Tensor, "batch n_key_value_heads key_pos d_head"],
    v_BGSJ: Float[Tensor, "batch n_key_value_heads key_pos d_head_v"],
    mask: MaskSpec,
    block_q: int = 256,
    block_k: int = 256,
) -> Float[Tensor, "batch pos n_heads d_head_v"]:
    """The FlashAttention algorithm in torch ops (the CPU path of ``attn_impl="flash"``).

    Queries are processed in tiles of ``block_q`` against key tiles of ``block_k`` with a running
    max ``m`` and running sum ``l`` (online softmax), so at most [B, H, block_q, block_k] scores
    exist at once, never [P, S]. Key tiles that the causal mask or sliding window hides
    entirely are skipped. A sink starts each row's running max at its logit and its sum at one.

    Example:
        >>> q, k, v = (cache[f"blocks.0.attn.hook_{name}"].transpose(1, 2) for name in ("rot_q", "rot_k", "v"))
        >>> z = tiled_flash_attention(q, k, v, MaskSpec(scale=1 / model.cfg.attn_scale), block_q=4, block_k=4)
        >>> torch.allclose(z, cache["blocks.0.attn.hook_z"], atol=1e-5)   # 14 positions in tiles of 4
        True
    """
    B, H, P, K = q_BHPK.shape
    G, S, J = k_BGSK.shape[1], k_BGSK.shape[2], v_BGSJ.shape[-1]
    g = H // G
    q_BGgPK = q_BHPK.view(B, G, g, P, K)
    out_BGgPJ = torch.empty(B, G, g, P, J, dtype=q_BHPK.dtype, device=q_BHPK.device)
    for q_start in range(0, P, block_q):
        q_end = min(q_start + block_q, P)
        n_q = q_end - q_start
        q_tile = q_BGgPK[:, :, :, q_start:q_end].reshape(B, G, g * n_q, K).float() * mask.scale
        if mask.sinks_H is None:
            m = torch.full((B, G, g * n_q, 1), float("-inf"), device=q_BHPK.device)
            l = torch.zeros(B, G, g * n_q, 1, device=q_BHPK.device)
        else:  # the sink as a key already seen: its exp(logit - m) = 1 with m = its logit
            sinks_1Gx1 = mask.sinks_H.float().to(q_BHPK.device).view(1, G, g, 1).repeat_interleave(n_q, dim=2)
            m = sinks_1Gx1.reshape(1, G, g * n_q, 1).expand(B, -1, -1, -1)
            l = torch.ones(B, G, g * n_q, 1, device=q_BHPK.device)
        acc = torch.zeros(B, G, g * n_q, J, device=q_BHPK.device)
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
            acc = acc * correction + p @ v_BGSJ[:, :, k_start:k_end].float()
            m = m_new
        out_BGgPJ[:, :, :, q_start:q_end] = (acc / l).view(B, G, g, n_q, J).to(q_BHPK.dtype)
    return out_BGgPJ.view(B, H, P, J).transpose(1, 2)


def flash_attention(
    q_BHPK: Float[Tensor, "batch n_heads pos d_head"],
    k_BGSK: Float[Tensor, "batch n_key_value_heads key_pos d_head"],
    v_BGSJ: Float[Tensor, "batch n_key_value_heads key_pos d_head_v"],
    mask: MaskSpec,
) -> Float[Tensor, "batch pos n_heads d_head_v"]:
    """``attn_impl="flash"``: the Triton kernel on CUDA where it applies, else the tiled torch path
    (which also takes sinks, padding masks, ALiBi, soft-caps and value widths unlike the key width).

    Example:
        >>> q, k, v = (cache[f"blocks.0.attn.hook_{name}"].transpose(1, 2) for name in ("rot_q", "rot_k", "v"))
        >>> z = flash_attention(q, k, v, MaskSpec(scale=1 / model.cfg.attn_scale))   # on the CPU: the tiled path
        >>> torch.allclose(z, cache["blocks.0.attn.hook_z"], atol=1e-5)
        True
    """
    if (q_BHPK.is_cuda and mask.alibi_slopes_H is None and mask.soft_cap is None and mask.key_mask_BS is None
            and mask.sinks_H is None and mask.chunk_size is None and mask.q_offset == 0
            and v_BGSJ.shape[-1] == q_BHPK.shape[-1]
            and q_BHPK.shape[2] == k_BGSK.shape[2]):
        from workbench.kernels import triton_available, triton_flash_attention

        if triton_available():
            z_BHPK = triton_flash_attention(q_BHPK, k_BGSK, v_BGSJ, causal=True,
                                            sliding_window=mask.sliding_window, scale=mask.scale)
            return nan_where_query_nonfinite(q_BHPK, z_BHPK).transpose(1, 2)
    return tiled_flash_attention(q_BHPK, k_BGSK, v_BGSJ, mask)


FAST_KERNELS = {"sdpa": sdpa_attention, "flash": flash_attention}
