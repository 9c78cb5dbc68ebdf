"""GPU tests of the Triton FlashAttention-2 kernels at realistic sizes (skipped without CUDA).

Each case compares our kernel and PyTorch's ``scaled_dot_product_attention`` (run in the
same low-precision dtype, K/V repeated per query-head group on the reference side only)
against an fp32 SDPA reference computed from the same inputs. Our error must stay within
a small multiple of SDPA's own low-precision error plus an absolute floor, the criterion
the FlashAttention repository uses; fp32 inputs are held to fixed tight tolerances.

Run these in their own pytest process (``pytest tests/gpu``): if triton was already
imported in interpreter mode (``TRITON_INTERPRET=1``, as tests/unit/test_triton_flash.py
arranges), they skip with a reason.

Shapes: q [batch, n_heads, pos, d_head]; k, v [batch, n_kv_heads, pos, d_head].
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]

if CUDA:  # import triton only where it will be used (see tests/unit/test_triton_flash.py)
    pytest.importorskip("triton", reason="triton is not installed (optional 'triton' extra)")
    from workbench.kernels import triton_flash as tf

    if tf._KERNELS_INTERPRETED:
        pytest.skip(
            "triton was imported in interpreter mode in this process (TRITON_INTERPRET=1); "
            "run tests/gpu in its own pytest process",
            allow_module_level=True,
        )

# (fwd absolute floor, grad absolute floor, allowed multiple of SDPA's own error)
TOLERANCES = {
    torch.float16: (2e-3, 5e-3, 2.0),
    torch.bfloat16: (1.6e-2, 4e-2, 2.0),
}


def _allowed_mask(pos: int, causal: bool, sliding_window: int | None, device) -> torch.Tensor | None:
    if not causal:
        return None
    i = torch.arange(pos, device=device)[:, None]
    j = torch.arange(pos, device=device)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed &= i - j < sliding_window
    return allowed


def sdpa_reference(q, k, v, *, causal, sliding_window=None, scale=None, dtype=None):
    """SDPA with K/V repeated per group, optionally upcast to ``dtype``."""
    group = q.shape[1] // k.shape[1]
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    if causal and sliding_window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    mask = _allowed_mask(q.shape[2], causal, sliding_window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _make(batch, n_heads, n_kv_heads, pos, d_head, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float32, generator=gen).to(dtype)

    q = randn(batch, n_heads, pos, d_head).requires_grad_(True)
    k = randn(batch, n_kv_heads, pos, d_head).requires_grad_(True)
    v = randn(batch, n_kv_heads, pos, d_head).requires_grad_(True)
    do = randn(batch, n_heads, pos, d_head)
    return q, k, v, do


def _fwd_bwd(fn, q, k, v, do, **kwargs):
    out = fn(q, k, v, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), do)
    return out, grads


def _max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


def _check(batch, n_heads, n_kv_heads, pos, d_head, dtype, causal=True, sliding_window=None, scale=None):
    q, k, v, do = _make(batch, n_heads, n_kv_heads, pos, d_head, dtype)
    kwargs = dict(causal=causal, sliding_window=sliding_window, scale=scale)
    out, grads = _fwd_bwd(tf.triton_flash_attention, q, k, v, do, **kwargs)
    ref, ref_grads = _fwd_bwd(
        lambda *a, **kw: sdpa_reference(*a, **kw, dtype=torch.float32), q, k, v, do.float(), **kwargs
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    for g in grads:
        assert torch.isfinite(g).all()

    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
        for name, got, want in zip("qkv", grads, ref_grads):
            torch.testing.assert_close(got, want.float(), atol=1e-3, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")
        return

    low, low_grads = _fwd_bwd(sdpa_reference, q, k, v, do, **kwargs)
    fwd_floor, grad_floor, factor = TOLERANCES[dtype]
    err, base = _max_err(out, ref), _max_err(low, ref)
    assert err <= factor * base + fwd_floor, f"out: error {err:.3g} vs SDPA {dtype} error {base:.3g}"
    for name, got, low_g, want in zip("qkv", grads, low_grads, ref_grads):
        err, base = _max_err(got, want), _max_err(low_g, want)
        assert err <= factor * base + grad_floor, f"d{name}: error {err:.3g} vs SDPA {dtype} error {base:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d_head", [64, 128])
@pytest.mark.parametrize("pos", [1024, 1000])
def test_gqa_causal_matches_sdpa(pos, d_head, dtype):
    _check(2, 8, 2, pos, d_head, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d_head", [64, 128])
def test_noncausal_matches_sdpa(d_head, dtype):
    _check(2, 8, 2, 1000, d_head, dtype, causal=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(8, 8), (8, 1)], ids=["mha", "mqa"])
def test_mha_and_mqa(n_heads, n_kv_heads, dtype):
    _check(2, n_heads, n_kv_heads, 1000, 64, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("sliding_window", [1, 100, 256, 4096])
def test_sliding_window(sliding_window, dtype):
    _check(2, 8, 2, 1000, 64, dtype, sliding_window=sliding_window)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_padded_head_dim_96(dtype):
    _check(2, 8, 2, 1000, 96, dtype)


@pytest.mark.parametrize("pos", [1, 17, 129])
def test_short_sequences(pos):
    _check(1, 4, 2, pos, 64, torch.float16)


@pytest.mark.parametrize("causal", [True, False])
def test_fp32_is_ieee_accurate(causal):
    _check(1, 4, 2, 1000, 64, torch.float32, causal=causal)


def test_custom_scale():
    _check(2, 8, 2, 1000, 128, torch.bfloat16, scale=0.05)


def test_forward_memory_is_linear_and_shares_kv():
    """No pos x pos scores and no per-query-head copies of K/V in the forward."""
    batch, n_heads, n_kv_heads, pos, d_head = 1, 16, 1, 4096, 64
    q, k, v, _ = _make(batch, n_heads, n_kv_heads, pos, d_head, torch.float16)
    with torch.no_grad():
        tf.triton_flash_attention(q, k, v)  # compile outside the measurement
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = tf.triton_flash_attention(q, k, v)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
    lse_bytes = batch * n_heads * pos * 4
    # a repeated K/V would add 2 * 16 * 4096 * 64 * 2 bytes = 16 MiB; one head's scores 32 MiB
    assert extra <= out.numel() * out.element_size() + lse_bytes + (1 << 20), f"extra {extra} bytes"
