"""A model split between the CPU and disk offload (accelerate) against the same model in memory.

SmolLM2-135M from its GGUF with ``max_memory={"cpu": "300MiB"}`` (the rest of its blocks offloaded to
disk) and loaded whole; forward on a 15-token prompt, medians of interleaved repeats. The offload
folder sits in the page cache here, so this is the cost of reading blocks back, not of a cold disk.

    python tests/benchmarks/bench_offload.py [--quick]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import workbench as wb
from tests.benchmarks.common import interleaved_timings, script_main, timing_rows

PROMPT = "When Mary and John went to the store, John gave a drink to"


def run(quick: bool = False) -> list[dict]:
    in_memory = wb.load_model("smollm2-135m", progress=False)
    tokens = in_memory.to_tokens(PROMPT)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        offloaded = wb.load_model("smollm2-135m", device_map="auto", max_memory={"cpu": "300MiB"},
                                  offload_folder=folder, progress=False)
        load_s = time.perf_counter() - start
        with torch.no_grad():
            diff = (offloaded(tokens) - in_memory(tokens)).abs().max().item()
        times = interleaved_timings({"in memory": lambda: in_memory(tokens), "CPU + disk offload": lambda: offloaded(tokens)},
                                    3 if quick else 9)
        on_disk = sum(device == "disk" for device in offloaded.device_map.values())
    rows = timing_rows(f"forward, SmolLM2-135M, {tokens.shape[1]} tokens ({on_disk} of 30 blocks on disk)", times,
                       "in memory")
    for row in rows:
        row["max_abs_diff_vs_in_memory"] = diff if row["contender"] != "in memory" else 0.0
        row["load_s"] = round(load_s, 2) if row["contender"] != "in memory" else ""
    return rows


if __name__ == "__main__":
    script_main(__name__, "CPU + disk offload", "3 repeats instead of 9")
