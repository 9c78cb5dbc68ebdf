"""Attention kernel memory and time against sequence length: eager vs sdpa vs flash.

Peak memory is measured, not estimated: each (kernel, length) runs in a fresh subprocess that
allocates q/k/v, resets the kernel's record of its peak resident set size to the current size
(``/proc/self/clear_refs``), runs the kernel once and reads the peak (``VmHWM``); the difference
is the kernel's own peak working memory. (The process-lifetime peak, ``ru_maxrss``, cannot be
used: importing torch and transformers peaks higher than a small kernel ever does, which
showed as 0 MB for every sdpa and flash run before this fix.)

    python tests/benchmarks/bench_attention_memory.py [--quick]
"""

from __future__ import annotations

import json
import subprocess
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))

from tests.benchmarks.common import script_main

# One Llama-like layer's attention: 8 query heads sharing 2 K/V heads, d_head 64, batch 1.
SHAPE = dict(batch=1, heads=8, kv_heads=2, d_head=64)

_CHILD = r"""
import json, sys, time, torch
from workbench.components.attention_kernels import MaskSpec, eager_attention, flash_attention, sdpa_attention
impl, n, b, h, g, d = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:7])
kernel = {"eager": eager_attention, "sdpa": sdpa_attention, "flash": flash_attention}[impl]
torch.manual_seed(0)
q, k, v = torch.randn(b, h, n, d), torch.randn(b, g, n, d), torch.randn(b, g, n, d)
mask = MaskSpec(scale=d ** -0.5)
def status_mb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
with torch.no_grad():
    kernel(q[:, :, :64], k[:, :, :64], v[:, :, :64], mask)  # warm up code paths at a tiny size
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status_mb("VmRSS")
    start = time.perf_counter()
    kernel(q, k, v, mask)
    seconds = time.perf_counter() - start
    peak = status_mb("VmHWM")
print(json.dumps({"seconds": seconds, "peak_mb": peak - before}))
"""


def measure(impl: str, n: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, impl, str(n), *map(str, SHAPE.values())],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> list[dict]:
    """Rows: kernel, seq_len, seconds (median of interleaved repeats), peak MB, ratio to eager."""
    lengths = [512, 2048, 8192] if quick else [512, 1024, 2048, 4096, 8192]
    repeats = 1 if quick else 3
    rows = []
    for n in lengths:
        results = {impl: [] for impl in ("eager", "sdpa", "flash")}
        for _ in range(repeats):
            for impl in results:  # interleaved
                results[impl].append(measure(impl, n))
        eager_peak = sorted(r["peak_mb"] for r in results["eager"])[len(results["eager"]) // 2]
        for impl, runs in results.items():
            secs = sorted(r["seconds"] for r in runs)
            peak = sorted(r["peak_mb"] for r in runs)[len(runs) // 2]
            rows.append({"comparison": "attention memory/time", "contender": impl, "seq_len": n,
                         "median_s": secs[len(secs) // 2], "min_s": secs[0], "max_s": secs[-1], "repeats": repeats,
                         "peak_mb": peak, "peak_vs_eager": peak / eager_peak if eager_peak > 0 else float("nan")})
    return rows


if __name__ == "__main__":
    script_main(__name__, f"Attention kernels ({SHAPE}, causal, fp32): peak memory and time vs sequence length",
                "fewer lengths and one repeat")
