"""Ray sweep throughput: IOI head patching per prompt on SmolLM2-135M, in this process and on 1 and 2 Ray workers.

The sweep is ``experiments.ioi.ioi_per_prompt`` (each prompt's clean and corrupted logit
difference and all 270 heads' patching effects) over ``ioi_dataset(model, n, seed=0)``:
  - in this process (no Ray; torch's default threads): the reference for Ray's overhead;
  - ``WorkerPool(workers=1, cpus_per_worker=1)``: one worker of one core, the unit that scaling out adds;
  - ``WorkerPool(workers=1, cpus_per_worker=cores)``: one worker with every core as its torch threads;
  - ``WorkerPool(workers=2, cpus_per_worker=cores // 2)``: two workers, shards to whichever is free.
``speedup_vs_1_worker`` divides the one-core worker's median by each row's: what adding a worker of
the same size gives. The goal compares the two-worker row with it; the whole-machine worker shows
what threads alone already get on the same cores (the sweep is matrix products, which thread well).
Each pool is started once (Ray's local cluster too); its workers' model load (``load_s``, the median
over workers) and the whole start (``pool_start_s``: worker processes, imports, load) are reported
apart and excluded from the timings, which are medians of ``repeats`` sweeps after one warm-up shard
per worker. The sharded results are checked against the in-process ones (1e-4) before any time is
reported. Full size: 12 prompts, 3 repeats; ``--quick``: 4 prompts, 3 repeats.

    python tests/benchmarks/bench_distributed.py [--quick]
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

import workbench as wb
from experiments.datasets import ioi_dataset
from experiments.distributed import WorkerPool
from experiments.ioi import ioi_per_prompt
from tests.benchmarks.common import script_main

MODEL = "smollm2-135m"
TOLERANCE = 1e-4


def _row(contender: str, workers, threads: int, n: int, times: list[float], **extra) -> dict:
    median = statistics.median(times)
    return {"comparison": f"IOI head patching per prompt, {n} prompts (SmolLM2-135M, 270 heads)",
            "contender": contender, "workers": workers, "threads_per_worker": threads, "prompts": n,
            "median_s": median, "min_s": min(times), "max_s": max(times), "repeats": len(times),
            "prompts_per_s": n / median, **extra}


def _check(rows, expected) -> float:
    diff = float(np.abs(rows[["metric", "delta"]].to_numpy() - expected[["metric", "delta"]].to_numpy()).max())
    assert diff < TOLERANCE, f"the sharded sweep differs from the in-process one by {diff}"
    return diff


def run(quick: bool = False) -> list[dict]:
    """Rows for BENCHMARKS.md: in-process, then Ray workers (1 x 1 core, 1 x all cores, 2 x half) over one IOI sweep."""
    import ray

    try:
        model = wb.load_model(MODEL, progress=False).eval()
    except wb.CheckpointError as error:
        print(f"SmolLM2 is not installed ({error}): skipped")
        return []
    n, repeats = (4, 3) if quick else (12, 3)
    cores = os.cpu_count() or 1
    data = ioi_dataset(model, n, seed=0)
    with torch.no_grad():
        ioi_per_prompt(model, data.select(slice(0, 1)))  # warm-up
        in_process, expected = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            expected = ioi_per_prompt(model, data)
            in_process.append(time.perf_counter() - start)
    rows = [_row("in this process (no Ray)", "-", torch.get_num_threads(), n, in_process)]
    started = time.perf_counter()
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    ray_start = time.perf_counter() - started
    try:
        for workers, cpus in ((1, 1), (1, cores), (2, max(1, cores // 2))):
            started = time.perf_counter()
            with WorkerPool(MODEL, workers=workers, cpus_per_worker=cpus) as pool:
                pool_start = time.perf_counter() - started
                pool.run(ioi_per_prompt, data.select(slice(0, workers)), shard_size=1, progress=False)  # warm-up
                times, diff = [], 0.0
                for _ in range(repeats):
                    result = pool.run(ioi_per_prompt, data, progress=False)
                    times.append(result.attrs["sharding"]["seconds"])
                    diff = max(diff, _check(result, expected))
                shards = result.attrs["sharding"]["shards"]
            name = f"Ray, {workers} worker{'s' if workers > 1 else ''} x {cpus} core{'s' if cpus > 1 else ''}"
            rows.append(_row(name, workers, cpus, n, times, shards=shards, load_s=statistics.median(pool.load_s),
                             pool_start_s=pool_start, ray_start_s=ray_start, max_abs_diff_vs_in_process=diff))
    finally:
        ray.shutdown()
    unit = rows[1]["median_s"]  # one worker of one core
    for row in rows:
        row["speedup_vs_1_worker"] = unit / row["median_s"]
    rows[3]["goal_met"] = rows[3]["median_s"] < unit
    for row in rows:
        row["model"] = "SmolLM2-135M"
    return rows


if __name__ == "__main__":
    script_main(__name__, "Ray sweep throughput", "4 prompts instead of 12")
