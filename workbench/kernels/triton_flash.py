"""FlashAttention-2 forward and backward written in Triton.

Shape legend
------------
    batch       number of sequences
    n_heads     query heads (``H``)
    n_kv_heads  key/value heads (``H_kv``); ``n_heads % n_kv_heads == 0``.
                ``group = n_heads // n_kv_heads`` query heads share one KV head
                (MHA: group 1, GQA: 1 < group < n_heads, MQA: n_kv_heads 1).
    pos         sequence length (``N``); queries and keys have the same length
    d_head      head dimension (``D``), 1..128; padded internally to
                ``BLOCK_D = max(16, next_power_of_two(D))`` with masked loads
                (``tl.arange`` needs a power of two, ``tl.dot`` at least 16)

    q    [batch, n_heads,    pos, d_head]
    k, v [batch, n_kv_heads, pos, d_head]
    out  [batch, n_heads,    pos, d_head]
    lse  [batch, n_heads,    pos]   float32, log2-domain log-sum-exp per row,
                                     saved by the forward for the backward

Algorithm
---------
Forward (one program per ``BLOCK_M`` query rows of one (batch, head)): walk
over ``BLOCK_N``-wide key/value tiles of the shared KV head
``kv_head = head // group`` keeping a running row max ``m``, running
denominator ``l`` and an unnormalised fp32 accumulator (online softmax), so the
``N x N`` score matrix is never materialised. Scores are computed as
``q @ k^T * (scale * log2(e))`` and exponentiated with ``exp2``; the kernel
stores ``lse2 = m + log2(l)`` per row.

Backward: a preprocess kernel computes ``delta = rowsum(dO * O)``; one kernel
owns a ``BLOCK_N`` tile of K/V of one KV head and loops over every query head
of its group and every relevant query tile, recomputing
``P = exp2(q k^T * scale * log2(e) - lse2)`` to accumulate ``dV += P^T dO`` and
``dK += dS^T Q`` (``dS = P * (dP - delta)``, ``dP = dO V^T``) — so the GQA group
sum happens in registers, without atomics and without copying K/V per query
head. A second kernel owns a query tile and accumulates ``dQ += dS K``.

Masking: ``causal`` lets query ``i`` see key ``j`` iff ``j <= i``;
``sliding_window=w`` (causal only) additionally requires ``i - w < j``, i.e.
the window counts the current token (same as Mistral / HF
``q_idx - kv_idx < sliding_window``). Every loop is split into tile ranges
that are fully visible (no mask arithmetic at all) and ranges on the diagonal,
the left window edge or the sequence end (masked); tiles that are entirely
masked (above the diagonal, left of the window) are never visited.

Block sizes (GPU)
-----------------
Chosen from ``_GPU_CONFIGS`` by input kind and padded head dim; each entry is
``BLOCK_M, BLOCK_N, num_warps, num_stages``::

    inputs     BLOCK_D | forward        | backward dK/dV | backward dQ
    ---------- --------+----------------+----------------+---------------
    fp16/bf16  <= 64   | 128, 64, 8, 3  | 32, 128, 8, 3  | 128, 32, 4, 3
    fp16/bf16  128     | 128, 64, 8, 2  | 16, 128, 8, 2  | 128, 32, 8, 2
    fp32       <= 64   |  64, 32, 8, 2  | 16,  32, 4, 2  |  32, 32, 4, 2
    fp32       128     |  32, 16, 8, 2  | 16,  64, 8, 2  |  32, 16, 8, 2

Why: every kernel keeps fp32 accumulators in registers — the forward a
``BLOCK_M x BLOCK_D`` output tile, dK/dV *two* ``BLOCK_N x BLOCK_D`` tiles, dQ
one ``BLOCK_M x BLOCK_D`` tile — and the tiles are the largest that compile
without register spills (checked with ptxas for sm_90 and sm_80, causal with
and without a window, where the extra masked loop raises register pressure).
Large query tiles in the forward / dQ and large key tiles in dK/dV maximise
reuse of the tile held in registers while the other operand streams through
shared memory, as in Triton's fused-attention tutorial. Eight warps split the
accumulator where four would spill (and map onto two Hopper warpgroups).
Three pipeline stages at ``D <= 64``, two at ``D = 128`` keep shared memory
under ~100 KB so consumer GPUs (99 KB per block) run every configuration.
fp32 inputs use exact ``ieee`` products, which run on CUDA cores rather than
tensor cores and need far more registers per tile, hence much smaller tiles
(fp32 is the accuracy path, not the fast path).
These are spill-free starting points, not autotuned optima.

Under the Triton interpreter (``TRITON_INTERPRET=1``, CPU) all tiles are 16
wide, which keeps the numpy emulation fast and still exercises multi-tile
loops, diagonal tiles and window edges on tiny test inputs.

Precision: everything accumulates in fp32. For fp32 inputs every ``tl.dot``
uses ``input_precision="ieee"`` (no TF32), so fp32 results match an eager
reference closely; fp16/bf16 inputs use the tensor cores' native precision and
``P``/``dS`` are rounded to the input dtype before their matmuls (as in
FlashAttention-2).

Interpreter mode: ``TRITON_INTERPRET=1`` must be set before ``triton`` is first
imported in the process (triton's own ``tl.*`` helpers and the ``@triton.jit``
decorators below are built in the mode in force at import time). The mode is
fixed at import: CPU tensors are accepted only when this module was imported
in interpreter mode, and a mismatch between triton's mode and this module's
raises a ``RuntimeError`` naming the fix.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
from jaxtyping import Float

import triton
import triton.language as tl

__all__ = ["triton_flash_attention"]

_MAX_HEAD_DIM = 128
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` is on right now (read the way triton reads it)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _triton_import_mode() -> bool | None:
    """Whether ``triton`` itself was imported in interpreter mode (None if undetectable)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - layout of other triton versions
        return None
    for name in ("zeros", "max", "sum", "cdiv"):
        fn = getattr(tl, name, None)
        if isinstance(fn, InterpretedFunction):
            return True
        if isinstance(fn, JITFunction):
            return False
    return None


# The mode the @triton.jit decorators below run in (fixed for the life of the process).
_KERNELS_INTERPRETED: bool = _interpret_requested()
_TRITON_INTERPRETED: bool | None = _triton_import_mode()


# --------------------------------------------------------------------------------------
# Loop bounds
# --------------------------------------------------------------------------------------


@triton.jit
def _key_ranges(
    start_m,
    N,
    WINDOW,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Key-tile ranges for the query tile starting at ``start_m``.

    Returns ``lo, mid_lo, mid_hi, hi``: ``[lo, mid_lo)`` masked (left window edge),
    ``[mid_lo, mid_hi)`` fully visible, ``[mid_hi, hi)`` masked (diagonal / sequence end).
    All bounds except ``hi`` are multiples of ``BLOCK_N`` (``BLOCK_M % BLOCK_N == 0``).
    """
    if CAUSAL:
        mid_hi = start_m
        hi = tl.minimum(start_m + BLOCK_M, N)
        if HAS_WINDOW:
            # first key any row of the tile sees: start_m - WINDOW + 1
            lo = (tl.maximum(start_m - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
            # first key that every row of the tile sees: start_m + BLOCK_M - WINDOW
            mid_lo = ((tl.maximum(start_m + BLOCK_M - WINDOW, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
            mid_lo = tl.minimum(mid_lo, mid_hi)
        else:
            lo = 0
            mid_lo = 0
    else:
        lo = 0
        mid_lo = 0
        mid_hi = (N // BLOCK_N) * BLOCK_N
        hi = N
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _query_ranges(
    start_n,
    N,
    WINDOW,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Query-tile ranges for the key tile starting at ``start_n``.

    Returns ``diag_lo, diag_hi, mid_lo, mid_hi, tail_hi``: ``[diag_lo, diag_hi)`` masked
    (diagonal), ``[mid_lo, mid_hi)`` fully visible, ``[mid_hi, tail_hi)`` masked (right
    window edge / sequence end). ``BLOCK_N % BLOCK_M == 0``.
    """
    n_floor = (N // BLOCK_M) * BLOCK_M
    if CAUSAL:
        diag_lo = start_n
        diag_hi = tl.minimum(start_n + BLOCK_N, N)
        mid_lo = start_n + BLOCK_N
        mid_hi = n_floor
        tail_hi = N
        if HAS_WINDOW:
            # rows i < start_n + WINDOW see every key of the tile ...
            mid_hi = tl.minimum(mid_hi, ((start_n + WINDOW) // BLOCK_M) * BLOCK_M)
            # ... and rows i >= start_n + BLOCK_N - 1 + WINDOW see none of it
            tail_hi = tl.minimum(N, start_n + BLOCK_N + WINDOW - 1)
        mid_hi = tl.maximum(mid_hi, mid_lo)
    else:
        diag_lo = 0
        diag_hi = 0
        mid_lo = 0
        mid_hi = n_floor
        tail_hi = N
    return diag_lo, diag_hi, mid_lo, mid_hi, tail_hi


@triton.jit
def _visible(
    q_idx,
    k_idx,
    N,
    WINDOW,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Broadcast mask: query ``q_idx`` may attend to key ``k_idx``.

    Pass ``offs_m[:, None], offs_n[None, :]`` for a ``[query, key]`` tile or
    ``offs_m[None, :], offs_n[:, None]`` for the transposed ``[key, query]`` tile.
    """
    keep = (q_idx < N) & (k_idx < N)
    if CAUSAL:
        keep = keep & (k_idx <= q_idx)
    if HAS_WINDOW:
        keep = keep & (k_idx > q_idx - WINDOW)
    return keep


@triton.jit
def _load_tile(
    ptrs,
    offs_rows,
    N,
    offs_d,
    CHECK_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Load a ``[rows, BLOCK_D]`` tile, masking only what can be out of range.

    Row checks only on boundary tiles, column checks only when ``d_head`` is padded,
    so fully-interior tiles of unpadded heads are plain (vectorisable) loads.
    """
    if CHECK_ROWS:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs, mask=(offs_rows < N)[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=(offs_rows < N)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    return tile


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    offs_m,
    offs_d,
    lo,
    hi,
    N,
    WINDOW,
    qk_scale,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        k = _load_tile(k_ptrs, offs_n, N, offs_d, MASKED, HEAD_DIM, BLOCK_D)
        v = _load_tile(v_ptrs, offs_n, N, offs_d, MASKED, HEAD_DIM, BLOCK_D)
        # scores in log2 units: (q . k) * scale * log2(e)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            keep = _visible(offs_m[:, None], offs_n[None, :], N, WINDOW, CAUSAL, HAS_WINDOW)
            qk = tl.where(keep, qk, float("-inf"))
        # m_i starts at -1e30 (finite), so a row whose tile is fully masked gets
        # p = exp2(-inf) = 0 and alpha = 1 instead of NaN.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    H,
    N,
    GROUP,
    WINDOW,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kv_h = (h // GROUP).to(tl.int64)  # shared KV head of this query head
    h = h.to(tl.int64)

    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh
    o_base = O + b * stride_ob + h * stride_oh

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < N
    tile_mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)

    q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, mask=tile_mask, other=0.0)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _key_ranges(start_m, N, WINDOW, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    # left window edge (masked), fully visible tiles (no mask), diagonal / tail (masked)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, lo, mid_lo, N, WINDOW, qk_scale,
                               BLOCK_N, HEAD_DIM, BLOCK_D, True, CAUSAL, HAS_WINDOW, DOT_PRECISION)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, mid_lo, mid_hi, N, WINDOW, qk_scale,
                               BLOCK_N, HEAD_DIM, BLOCK_D, False, CAUSAL, HAS_WINDOW, DOT_PRECISION)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, mid_hi, hi, N, WINDOW, qk_scale,
                               BLOCK_N, HEAD_DIM, BLOCK_D, True, CAUSAL, HAS_WINDOW, DOT_PRECISION)

    # rows past the sequence end saw nothing (l == 0); keep them finite, they are not stored
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(o_base + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=tile_mask)
    tl.store(LSE + pid_bh.to(tl.int64) * N + offs_m, m_i + tl.math.log2(l_safe), mask=row_mask)


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess_kernel(
    O,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    H,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d]  (fp32)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < N
    tile_mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
                mask=tile_mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                 mask=tile_mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    tl.store(DELTA + pid_bh.to(tl.int64) * N + offs_m, delta, mask=row_mask)


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    stride_qn,
    stride_qd,
    stride_don,
    stride_dod,
    offs_n,
    offs_d,
    lo,
    hi,
    N,
    WINDOW,
    qk_scale,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd
        do_ptrs = do_base + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod
        q = _load_tile(q_ptrs, offs_m, N, offs_d, MASKED, HEAD_DIM, BLOCK_D)
        do = _load_tile(do_ptrs, offs_m, N, offs_d, MASKED, HEAD_DIM, BLOCK_D)
        if MASKED:
            lse = tl.load(lse_base + offs_m, mask=offs_m < N, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=offs_m < N, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        # transposed problem: rows are keys, columns are queries
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            keep_t = _visible(offs_m[None, :], offs_n[:, None], N, WINDOW, CAUSAL, HAS_WINDOW)
            qk_t = tl.where(keep_t, qk_t, float("-inf"))
        p_t = tl.math.exp2(qk_t - lse[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    LSE,
    DELTA,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    H,
    H_KV,
    N,
    GROUP,
    WINDOW,
    qk_scale,
    sm_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    b = pid_bkv // H_KV
    kv_h = pid_bkv % H_KV
    b64 = b.to(tl.int64)
    kv_h64 = kv_h.to(tl.int64)

    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tile_mask = (offs_n[:, None] < N) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(K + b64 * stride_kb + kv_h64 * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=tile_mask, other=0.0)
    v = tl.load(V + b64 * stride_vb + kv_h64 * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=tile_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    diag_lo, diag_hi, mid_lo, mid_hi, tail_hi = _query_ranges(
        start_n, N, WINDOW, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)

    # sum over the query heads that share this KV head (GQA / MQA)
    for g in range(0, GROUP):
        h = kv_h * GROUP + g
        h64 = h.to(tl.int64)
        q_base = Q + b64 * stride_qb + h64 * stride_qh
        do_base = DO + b64 * stride_dob + h64 * stride_doh
        row_base = (b64 * H + h64) * N
        lse_base = LSE + row_base
        delta_base = DELTA + row_base
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                             stride_qn, stride_qd, stride_don, stride_dod, offs_n, offs_d,
                             diag_lo, diag_hi, N, WINDOW, qk_scale,
                             BLOCK_M, HEAD_DIM, BLOCK_D, True, CAUSAL, HAS_WINDOW, DOT_PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                             stride_qn, stride_qd, stride_don, stride_dod, offs_n, offs_d,
                             mid_lo, mid_hi, N, WINDOW, qk_scale,
                             BLOCK_M, HEAD_DIM, BLOCK_D, False, CAUSAL, HAS_WINDOW, DOT_PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                             stride_qn, stride_qd, stride_don, stride_dod, offs_n, offs_d,
                             mid_hi, tail_hi, N, WINDOW, qk_scale,
                             BLOCK_M, HEAD_DIM, BLOCK_D, True, CAUSAL, HAS_WINDOW, DOT_PRECISION)

    dk = dk * sm_scale
    tl.store(DK + b64 * stride_dkb + kv_h64 * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=tile_mask)
    tl.store(DV + b64 * stride_dvb + kv_h64 * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=tile_mask)


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    offs_m,
    offs_d,
    lo,
    hi,
    N,
    WINDOW,
    qk_scale,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        k = _load_tile(k_ptrs, offs_n, N, offs_d, MASKED, HEAD_DIM, BLOCK_D)
        v = _load_tile(v_ptrs, offs_n, N, offs_d, MASKED, HEAD_DIM, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            keep = _visible(offs_m[:, None], offs_n[None, :], N, WINDOW, CAUSAL, HAS_WINDOW)
            qk = tl.where(keep, qk, float("-inf"))
        p = tl.math.exp2(qk - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_dqb,
    stride_dqh,
    stride_dqn,
    stride_dqd,
    H,
    N,
    GROUP,
    WINDOW,
    qk_scale,
    sm_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kv_h = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < N
    tile_mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=tile_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                 mask=tile_mask, other=0.0)
    row_base = pid_bh.to(tl.int64) * N
    lse = tl.load(LSE + row_base + offs_m, mask=row_mask, other=0.0)
    delta = tl.load(DELTA + row_base + offs_m, mask=row_mask, other=0.0)

    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _key_ranges(start_m, N, WINDOW, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, lo, mid_lo, N, WINDOW, qk_scale,
                   BLOCK_N, HEAD_DIM, BLOCK_D, True, CAUSAL, HAS_WINDOW, DOT_PRECISION)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, mid_lo, mid_hi, N, WINDOW, qk_scale,
                   BLOCK_N, HEAD_DIM, BLOCK_D, False, CAUSAL, HAS_WINDOW, DOT_PRECISION)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, mid_hi, hi, N, WINDOW, qk_scale,
                   BLOCK_N, HEAD_DIM, BLOCK_D, True, CAUSAL, HAS_WINDOW, DOT_PRECISION)

    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=tile_mask)


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------


class _Tile(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


class _Config(NamedTuple):
    fwd: _Tile
    dkdv: _Tile
    dq: _Tile


# (fp32 inputs?, largest padded head dim) -> tiles; see "Block sizes" in the module docstring
_GPU_CONFIGS: dict[tuple[bool, int], _Config] = {
    (False, 64): _Config(fwd=_Tile(128, 64, 8, 3), dkdv=_Tile(32, 128, 8, 3), dq=_Tile(128, 32, 4, 3)),
    (False, 128): _Config(fwd=_Tile(128, 64, 8, 2), dkdv=_Tile(16, 128, 8, 2), dq=_Tile(128, 32, 8, 2)),
    (True, 64): _Config(fwd=_Tile(64, 32, 8, 2), dkdv=_Tile(16, 32, 4, 2), dq=_Tile(32, 32, 4, 2)),
    (True, 128): _Config(fwd=_Tile(32, 16, 8, 2), dkdv=_Tile(16, 64, 8, 2), dq=_Tile(32, 16, 8, 2)),
}
_INTERPRETER_CONFIG = _Config(fwd=_Tile(16, 16, 4, 1), dkdv=_Tile(16, 16, 4, 1), dq=_Tile(16, 16, 4, 1))

for _cfg in (*_GPU_CONFIGS.values(), _INTERPRETER_CONFIG):
    # the loop-bound logic relies on these divisibilities
    assert _cfg.fwd.block_m % _cfg.fwd.block_n == 0
    assert _cfg.dq.block_m % _cfg.dq.block_n == 0
    assert _cfg.dkdv.block_n % _cfg.dkdv.block_m == 0


def _config(block_d: int, dtype: torch.dtype, interpret: bool) -> _Config:
    if interpret:
        return _INTERPRETER_CONFIG
    fp32 = dtype == torch.float32
    for max_d in sorted(d for is_fp32, d in _GPU_CONFIGS if is_fp32 == fp32):
        if block_d <= max_d:
            return _GPU_CONFIGS[(fp32, max_d)]
    raise AssertionError(f"no config for BLOCK_D={block_d}")  # unreachable: d_head is validated


def _check_mode() -> bool:
    """The interpreter mode the kernels run in; raises if it cannot work in this process."""
    if _TRITON_INTERPRETED is not None and _TRITON_INTERPRETED != _KERNELS_INTERPRETED:
        raise RuntimeError(
            f"triton was imported with TRITON_INTERPRET={'1' if _TRITON_INTERPRETED else 'unset'} but "
            f"workbench.kernels.triton_flash with TRITON_INTERPRET={'1' if _KERNELS_INTERPRETED else 'unset'}; "
            "set TRITON_INTERPRET before the first `import triton` of the process"
        )
    return _KERNELS_INTERPRETED


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    sliding_window: int | None,
    interpret: bool,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, heads, pos, d_head], got rank {t.dim()} with shape {tuple(t.shape)}"
            )
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} has unsupported dtype {t.dtype}; expected float16, bfloat16 or float32")
        if not interpret and t.device.type != "cuda":
            raise ValueError(
                f"{name} is on device '{t.device}', but the Triton flash-attention kernels need CUDA tensors "
                "(to run them on the CPU through the Triton interpreter, set TRITON_INTERPRET=1 before triton is imported)"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, n_heads, pos, d_head = q.shape
    kb, n_kv_heads, kpos, kd = k.shape
    if kb != batch:
        raise ValueError(f"batch mismatch: q has {batch}, k/v have {kb}")
    if kpos != pos:
        raise ValueError(f"sequence length mismatch: q has pos={pos}, k/v have pos={kpos}")
    if kd != d_head:
        raise ValueError(f"d_head mismatch: q has d_head={d_head}, k/v have d_head={kd}")
    if n_kv_heads == 0 or n_heads % n_kv_heads != 0:
        raise ValueError(
            f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads}) for grouped-query attention"
        )
    if not 1 <= d_head <= _MAX_HEAD_DIM:
        raise ValueError(
            f"unsupported d_head={d_head}: the kernels support 1 <= d_head <= {_MAX_HEAD_DIM} "
            "(padded internally to a power of two)"
        )
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        if not causal:
            raise ValueError("sliding_window requires causal=True (the window is defined over past tokens)")


def _block_d(d_head: int) -> int:
    return max(16, triton.next_power_of_2(d_head))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (no TF32); 16-bit inputs: native tensor-core path
    return "ieee" if dtype == torch.float32 else "tf32"


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int | None, scale: float, interpret: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, n_heads, pos, d_head = q.shape
    n_kv_heads = k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((batch, n_heads, pos), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    block_d = _block_d(d_head)
    cfg = _config(block_d, q.dtype, interpret).fwd
    grid = (triton.cdiv(pos, cfg.block_m), batch * n_heads)
    _fwd_kernel[grid](
        q, k, v, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        n_heads, pos, n_heads // n_kv_heads, window or 0, scale * math.log2(math.e),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, HEAD_DIM=d_head,
        CAUSAL=causal, HAS_WINDOW=window is not None, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, lse


def _backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    window: int | None,
    scale: float,
    interpret: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, n_heads, pos, d_head = q.shape
    n_kv_heads = k.shape[1]
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if q.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    block_d = _block_d(d_head)
    cfg = _config(block_d, q.dtype, interpret)
    group = n_heads // n_kv_heads
    qk_scale = scale * math.log2(math.e)
    has_window = window is not None
    window_arg = window or 0
    precision = _dot_precision(q.dtype)

    delta = torch.empty_like(lse)
    pre_m = 64 if not interpret else 16
    _bwd_preprocess_kernel[(triton.cdiv(pos, pre_m), batch * n_heads)](
        out, do, delta, *out.stride(), *do.stride(), n_heads, pos,
        BLOCK_M=pre_m, BLOCK_D=block_d, HEAD_DIM=d_head,
    )  # fmt: skip

    t = cfg.dkdv
    _bwd_dkdv_kernel[(triton.cdiv(pos, t.block_n), batch * n_kv_heads)](
        q, k, v, do, dk, dv, lse, delta,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        n_heads, n_kv_heads, pos, group, window_arg, qk_scale, scale,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=block_d, HEAD_DIM=d_head,
        CAUSAL=causal, HAS_WINDOW=has_window, DOT_PRECISION=precision,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip

    t = cfg.dq
    _bwd_dq_kernel[(triton.cdiv(pos, t.block_m), batch * n_heads)](
        q, k, v, do, dq, lse, delta,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        n_heads, pos, group, window_arg, qk_scale, scale,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=block_d, HEAD_DIM=d_head,
        CAUSAL=causal, HAS_WINDOW=has_window, DOT_PRECISION=precision,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return dq, dk, dv


class _TritonFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, window: int | None, scale: float, interpret: bool):
        out, lse = _forward(q, k, v, causal, window, scale, interpret)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        ctx.window = window
        ctx.scale = scale
        ctx.interpret = interpret
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, out, lse, ctx.causal, ctx.window, ctx.scale, ctx.interpret)
        return dq, dk, dv, None, None, None, None


def triton_flash_attention(
    q: Float[torch.Tensor, "batch n_heads pos d_head"],
    k: Float[torch.Tensor, "batch n_kv_heads pos d_head"],
    v: Float[torch.Tensor, "batch n_kv_heads pos d_head"],
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    scale: float | None = None,
) -> Float[torch.Tensor, "batch n_heads pos d_head"]:
    """Fused scaled-dot-product attention (FlashAttention-2) with autograd support.

    Computes ``softmax(q @ k^T * scale + mask) @ v`` per head without materialising the
    ``pos x pos`` score matrix. Key/value heads are shared by groups of
    ``n_heads // n_kv_heads`` query heads (GQA/MQA) without being copied.

    Args:
        q: queries ``[batch, n_heads, pos, d_head]``.
        k: keys ``[batch, n_kv_heads, pos, d_head]``; ``n_heads % n_kv_heads == 0``.
        v: values, same shape as ``k``.
        causal: query ``i`` attends to keys ``j <= i`` only.
        sliding_window: if given (requires ``causal``), query ``i`` attends to keys
            ``i - sliding_window < j <= i`` (the window includes the current token).
        scale: score scale, default ``1 / sqrt(d_head)``.

    Returns:
        Attention output shaped like ``q``, in ``q``'s dtype (fp32 accumulation inside).

    Raises:
        ValueError: wrong rank, mismatched shapes/dtypes/devices, ``n_heads`` not divisible
            by ``n_kv_heads``, ``d_head`` outside ``1..128``, non-CUDA tensors outside
            interpreter mode (``TRITON_INTERPRET=1`` set before triton is imported), or an
            invalid ``sliding_window``.
        RuntimeError: triton and this module were imported in different interpreter modes.

    Example:
        >>> q = torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        >>> k = torch.randn(2, 2, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        >>> v = torch.randn_like(k, requires_grad=True)
        >>> out = triton_flash_attention(q, k, v, causal=True, sliding_window=256)
        >>> out.shape
        torch.Size([2, 8, 1024, 64])
        >>> out.float().square().mean().backward()  # fills q.grad, k.grad, v.grad
    """
    interpret = _check_mode()
    _validate(q, k, v, causal, sliding_window, interpret)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _TritonFlashAttention.apply(q, k, v, bool(causal), sliding_window, float(scale), interpret)
