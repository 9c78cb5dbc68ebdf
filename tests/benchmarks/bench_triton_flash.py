"""Throughput of the Triton FlashAttention-2 kernel vs PyTorch SDPA's flash backend (CUDA only).

    python tests/benchmarks/bench_triton_flash.py [--quick] [--dtype bf16|fp16] [--repeats N]

Causal attention, batch * heads = 32 (batch 2 x 16 heads, MHA so both sides do the same
work), d_head 64 and 128, sequence lengths 1024..16384 (``--quick``: 1024 and 4096).
Contenders are timed in interleaved rounds (A B A B ...) with CUDA events and reported as
medians, so clock and thermal drift hit both alike.

FLOP convention: a causal forward does half of ``4 * batch * heads * pos^2 * d_head``
(two matmuls, upper triangle skipped). The backward does 2.5x the forward's FLOPs (five
matmuls, one of them the recomputation of ``q k^T``), so forward + backward counts
``3.5 x`` the forward FLOPs. Both contenders are charged the same FLOPs, so the ratio
column is independent of the convention.

Without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

BATCH, HEADS = 2, 16  # batch * heads = 32
FULL_SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
QUICK_SEQ_LENS = (1024, 4096)
HEAD_DIMS = (64, 128)
BWD_FLOP_FACTOR = 2.5  # backward FLOPs / forward FLOPs


def causal_fwd_flops(batch: int, heads: int, pos: int, d_head: int) -> float:
    return 0.5 * 4 * batch * heads * pos * pos * d_head


def time_interleaved(contenders: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median milliseconds per call for each contender, measured in interleaved rounds."""
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(values) for name, values in times.items()}


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph; calling the result replays it (no host launch overhead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, allocate) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run(seq_lens: tuple[int, ...], dtype: torch.dtype, repeats: int, use_graphs: bool = False) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from workbench.kernels.triton_flash import triton_flash_attention

    def sdpa_flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def ours(q, k, v):
        return triton_flash_attention(q, k, v, causal=True)

    impls = {"triton": ours, "sdpa-flash": sdpa_flash}
    rows = []
    for d_head in HEAD_DIMS:
        for pos in seq_lens:
            torch.manual_seed(0)
            shape = (BATCH, HEADS, pos, d_head)
            q, k, v, do = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4))
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

            with torch.no_grad():
                max_diff = (ours(q, k, v).float() - sdpa_flash(q, k, v).float()).abs().max().item()

            def fwd(fn):
                def call():
                    with torch.no_grad():
                        fn(q, k, v)

                return call

            def fwd_bwd(fn):
                def call():
                    out = fn(qg, kg, vg)
                    torch.autograd.grad(out, (qg, kg, vg), do)

                return call

            launch = graphed if use_graphs else (lambda call: call)
            fwd_ms = time_interleaved({name: launch(fwd(fn)) for name, fn in impls.items()}, repeats)
            fwd_bwd_ms = time_interleaved({name: launch(fwd_bwd(fn)) for name, fn in impls.items()}, repeats)
            flops = causal_fwd_flops(BATCH, HEADS, pos, d_head)
            for name in impls:
                rows.append({
                    "d_head": d_head,
                    "pos": pos,
                    "impl": name,
                    "fwd ms": fwd_ms[name],
                    "fwd TFLOP/s": flops / (fwd_ms[name] * 1e-3) / 1e12,
                    "fwd+bwd ms": fwd_bwd_ms[name],
                    "fwd+bwd TFLOP/s": (1 + BWD_FLOP_FACTOR) * flops / (fwd_bwd_ms[name] * 1e-3) / 1e12,
                    "fwd vs sdpa": fwd_ms["sdpa-flash"] / fwd_ms[name],
                    "fwd+bwd vs sdpa": fwd_bwd_ms["sdpa-flash"] / fwd_bwd_ms[name],
                    "max |out diff|": max_diff,
                })
            del q, k, v, do, qg, kg, vg
            torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    columns = list(rows[0])

    def fmt(value):
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e-2 else f"{value:.2f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sequence lengths 1024 and 4096 only, fewer repeats")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds per measurement")
    parser.add_argument("--graphs", action="store_true", help="also time CUDA-graph replays (GPU time alone)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_triton_flash: no CUDA device available; the Triton kernels need a GPU. Nothing to do.")
        return 0
    try:
        import triton
    except ImportError:
        print("bench_triton_flash: triton is not installed; install the optional triton extra. Nothing to do.")
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("bench_triton_flash: TRITON_INTERPRET is set; unset it to benchmark compiled kernels.")
        return 0

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    seq_lens = QUICK_SEQ_LENS if args.quick else FULL_SEQ_LENS
    repeats = args.repeats or (5 if args.quick else 15)
    props = torch.cuda.get_device_properties(0)
    print(f"### Triton FlashAttention-2 vs SDPA flash backend — {torch.cuda.get_device_name(0)}")
    print()
    print(f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}, Python {platform.python_version()}; {args.dtype}, causal, "
          f"batch {BATCH} x heads {HEADS}, medians of {repeats} interleaved rounds (CUDA events). "
          f"FLOPs: fwd = 2*b*h*n^2*d (causal half of 4*b*h*n^2*d), fwd+bwd = {1 + BWD_FLOP_FACTOR:g} x fwd. "
          f"'vs sdpa' > 1 means the Triton kernel is faster.")
    modes = [("each call launched from Python (host launch overhead included)", False)]
    if args.graphs:
        modes.append(("each call replayed from a CUDA graph (GPU time alone, no host launch overhead)", True))
    for title, use_graphs in modes:
        print(f"\n#### {title}\n")
        print(markdown(run(seq_lens, dtype, repeats, use_graphs=use_graphs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
