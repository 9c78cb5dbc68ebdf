"""CPU tests of the Triton FlashAttention-2 kernels, run through the Triton interpreter.

``TRITON_INTERPRET=1`` only takes effect if it is set before triton is first imported
in the process, so it is set here before any triton import. If something imported
triton in compiled mode earlier in the same pytest process (another test module, a
conftest, torch.compile), the kernel cases cannot run in-process; they are then skipped
here and ``test_cases_in_fresh_process`` runs this file again in a clean subprocess.

Shapes: q [batch, n_heads, pos, d_head]; k, v [batch, n_kv_heads, pos, d_head].
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_TRITON_PREIMPORTED = "triton" in sys.modules
if not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`

triton = pytest.importorskip("triton", reason="triton is not installed (optional 'triton' extra)")

import torch  # noqa: E402

from workbench.kernels import triton_available  # noqa: E402
from workbench.kernels import triton_flash as tf  # noqa: E402
from workbench.kernels import triton_flash_attention as package_triton_flash_attention  # noqa: E402

IN_PROCESS = tf._KERNELS_INTERPRETED and tf._TRITON_INTERPRETED is not False

needs_interpreter = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton was imported in compiled mode earlier in this process; "
    "the kernel cases run in a fresh subprocess instead (test_cases_in_fresh_process)",
)

FWD_ATOL = 1e-5
GRAD_ATOL = 1e-4


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sliding_window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Eager softmax(q k^T * scale + mask) v, K/V repeated per query-head group (float64)."""
    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double() for t in (q, k, v))
    k64 = k64.repeat_interleave(group, dim=1)
    v64 = v64.repeat_interleave(group, dim=1)
    pos = q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q64 @ k64.transpose(-1, -2)) * scale
    i = torch.arange(pos)[:, None]
    j = torch.arange(pos)[None, :]
    allowed = torch.ones(pos, pos, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if sliding_window is not None:
        allowed &= i - j < sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v64


def make_inputs(batch, n_heads, n_kv_heads, pos, d_head, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_heads, pos, d_head, generator=gen, dtype=torch.float32).to(dtype)
    k = torch.randn(batch, n_kv_heads, pos, d_head, generator=gen, dtype=torch.float32).to(dtype)
    v = torch.randn(batch, n_kv_heads, pos, d_head, generator=gen, dtype=torch.float32).to(dtype)
    do = torch.randn(batch, n_heads, pos, d_head, generator=gen, dtype=torch.float32).to(dtype)
    return q, k, v, do


def check_against_reference(
    q, k, v, do, *, causal, sliding_window=None, scale=None, fwd_atol=FWD_ATOL, grad_atol=GRAD_ATOL, fn=None
):
    fn = tf.triton_flash_attention if fn is None else fn
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, causal=causal, sliding_window=sliding_window, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    grads = torch.autograd.grad(out, (q, k, v), do)

    ref = reference_attention(q, k, v, causal=causal, sliding_window=sliding_window, scale=scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())

    torch.testing.assert_close(out.double(), ref, atol=fwd_atol, rtol=0)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want.double(), atol=grad_atol, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")


# (batch, n_heads, n_kv_heads, pos, d_head, causal, sliding_window); interpreter tiles are 16 wide
CASES = {
    "mha_causal_37": (1, 4, 4, 37, 16, True, None),
    "gqa_causal_50": (2, 6, 2, 50, 16, True, None),
    "mqa_causal_17": (1, 4, 1, 17, 16, True, None),
    "mha_noncausal_50": (1, 4, 4, 50, 16, False, None),
    "gqa_noncausal_37": (1, 6, 2, 37, 16, False, None),
    "mqa_noncausal_17": (1, 4, 1, 17, 16, False, None),
    "block_multiple_causal_32": (1, 2, 1, 32, 16, True, None),
    "block_multiple_noncausal_32": (1, 2, 2, 32, 16, False, None),
    "pos1_causal": (1, 2, 1, 1, 16, True, None),
    "pos1_noncausal": (2, 2, 2, 1, 16, False, None),
    "window7_of_37_gqa": (1, 6, 2, 37, 16, True, 7),
    "window7_of_50_mha": (1, 2, 2, 50, 16, True, 7),
    "window16_of_50_mqa": (1, 4, 1, 50, 16, True, 16),
    "window1_self_only": (1, 2, 1, 17, 16, True, 1),
    "window_ge_pos": (1, 2, 2, 37, 16, True, 64),
    "d64_gqa_causal_37": (1, 4, 2, 37, 64, True, None),
    "d64_noncausal_17": (1, 2, 1, 17, 64, False, None),
    "d96_padded_causal_37": (1, 2, 1, 37, 96, True, None),
    "d96_padded_window_17": (1, 2, 2, 17, 96, True, 5),
    "d24_padded_gqa_noncausal": (1, 4, 2, 20, 24, False, None),
}


@needs_interpreter
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_reference(case):
    batch, n_heads, n_kv_heads, pos, d_head, causal, window = CASES[case]
    q, k, v, do = make_inputs(batch, n_heads, n_kv_heads, pos, d_head)
    check_against_reference(q, k, v, do, causal=causal, sliding_window=window)


# GPU-shaped tiles (BLOCK_M != BLOCK_N) exercise the loop-bound arithmetic the 16x16
# interpreter default cannot: diagonals spanning several key tiles, window edges inside
# wide tiles, query tiles narrower than key tiles in dK/dV.
NON_SQUARE_TILES = {
    "fwd32x16_dkdv16x32_dq32x16": tf._Config(
        fwd=tf._Tile(32, 16, 4, 1), dkdv=tf._Tile(16, 32, 4, 1), dq=tf._Tile(32, 16, 4, 1)
    ),
    "fwd64x16_dkdv16x64_dq64x32": tf._Config(
        fwd=tf._Tile(64, 16, 4, 1), dkdv=tf._Tile(16, 64, 4, 1), dq=tf._Tile(64, 32, 4, 1)
    ),
}
NON_SQUARE_CASES = {
    "gqa_causal_77": (1, 4, 2, 77, 16, True, None),
    "gqa_window7_100": (1, 4, 2, 100, 16, True, 7),
    "mqa_window40_100": (1, 2, 1, 100, 16, True, 40),
    "mha_noncausal_50": (1, 2, 2, 50, 16, False, None),
}


@needs_interpreter
@pytest.mark.parametrize("tiles", list(NON_SQUARE_TILES))
@pytest.mark.parametrize("case", list(NON_SQUARE_CASES))
def test_non_square_tiles(monkeypatch, tiles, case):
    monkeypatch.setattr(tf, "_INTERPRETER_CONFIG", NON_SQUARE_TILES[tiles])
    batch, n_heads, n_kv_heads, pos, d_head, causal, window = NON_SQUARE_CASES[case]
    q, k, v, do = make_inputs(batch, n_heads, n_kv_heads, pos, d_head, seed=6)
    check_against_reference(q, k, v, do, causal=causal, sliding_window=window)


@needs_interpreter
def test_custom_scale():
    q, k, v, do = make_inputs(1, 4, 2, 37, 16, seed=1)
    check_against_reference(q, k, v, do, causal=True, scale=0.3)
    check_against_reference(q, k, v, do, causal=False, scale=0.05)


@needs_interpreter
def test_non_contiguous_inputs():
    # [batch, pos, heads, d_head] storage viewed as [batch, heads, pos, d_head]
    q, k, v, do = make_inputs(1, 4, 2, 37, 16, seed=2)
    q_t, k_t, v_t, do_t = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do))
    assert not q_t.is_contiguous()
    check_against_reference(q_t, k_t, v_t, do_t, causal=True, sliding_window=9)


@needs_interpreter
def test_fp16_inputs():
    q, k, v, do = make_inputs(1, 4, 2, 37, 16, dtype=torch.float16, seed=3)
    check_against_reference(q, k, v, do, causal=True, fwd_atol=3e-3, grad_atol=1e-2)


@needs_interpreter
def test_package_export_and_no_grad():
    assert triton_available()
    q, k, v, do = make_inputs(1, 4, 2, 17, 16, seed=4)
    check_against_reference(q, k, v, do, causal=True, fn=package_triton_flash_attention)
    with torch.no_grad():
        out = package_triton_flash_attention(q, k, v)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, causal=True), atol=FWD_ATOL, rtol=0)


@needs_interpreter
def test_gqa_group_heads_share_kv():
    # query heads of one group with identical queries must give identical outputs
    q, k, v, _ = make_inputs(1, 4, 2, 17, 16, seed=5)
    q[:, 1] = q[:, 0]  # heads 0 and 1 share kv head 0
    out = tf.triton_flash_attention(q, k, v)
    torch.testing.assert_close(out[:, 0], out[:, 1], atol=0, rtol=0)


# ---------------------------------------------------------------------- errors


@pytest.fixture
def validated_as_interpreter(monkeypatch):
    """Let CPU tensors through the device check so later checks are reached (no kernel runs)."""
    monkeypatch.setattr(tf, "_check_mode", lambda: True)


@pytest.mark.usefixtures("validated_as_interpreter")
@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "kwargs", "match"),
    [
        ((2, 17, 16), (2, 17, 16), {}, "rank 4"),
        ((1, 1, 2, 17, 16), (1, 1, 2, 17, 16), {}, "rank 4"),
        ((1, 6, 17, 16), (1, 4, 17, 16), {}, "n_heads \\(6\\) must be divisible by n_kv_heads \\(4\\)"),
        ((1, 4, 17, 16), (1, 2, 17, 32), {}, "d_head mismatch"),
        ((1, 2, 17, 256), (1, 2, 17, 256), {}, "unsupported d_head=256"),
        ((1, 2, 17, 16), (1, 2, 9, 16), {}, "sequence length mismatch"),
        ((1, 2, 17, 16), (2, 2, 17, 16), {}, "batch mismatch"),
        ((1, 2, 17, 16), (1, 2, 17, 16), {"sliding_window": 0}, "sliding_window must be a positive int"),
        ((1, 2, 17, 16), (1, 2, 17, 16), {"sliding_window": 4, "causal": False}, "requires causal=True"),
    ],
)
def test_shape_and_argument_errors(q_shape, kv_shape, kwargs, match):
    q = torch.zeros(q_shape)
    k = torch.zeros(kv_shape)
    with pytest.raises(ValueError, match=match):
        tf.triton_flash_attention(q, k, k.clone(), **kwargs)


@pytest.mark.usefixtures("validated_as_interpreter")
def test_dtype_errors():
    q = torch.zeros(1, 2, 17, 16)
    with pytest.raises(ValueError, match="share a dtype"):
        tf.triton_flash_attention(q, q.half(), q.half())
    with pytest.raises(ValueError, match="unsupported dtype torch.float64"):
        tf.triton_flash_attention(q.double(), q.double(), q.double())


def test_cpu_tensors_rejected_outside_interpreter(monkeypatch):
    monkeypatch.setattr(tf, "_check_mode", lambda: False)
    q = torch.zeros(1, 2, 17, 16)
    with pytest.raises(ValueError, match="need CUDA tensors.*TRITON_INTERPRET=1"):
        tf.triton_flash_attention(q, q, q)


# ---------------------------------------------------------------------- fallback


@pytest.mark.slow  # every case under the interpreter, in a process of its own
@pytest.mark.skipif(IN_PROCESS, reason="the kernel cases ran in this process")
def test_cases_in_fresh_process():
    repo_root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root), env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider"],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
