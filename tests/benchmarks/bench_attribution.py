"""Attribution graphs: ``experiments.attribution.attribute`` against circuit-tracer 0.5's ``attribute`` on the same
model, transcoders and prompts of 32, 128 and 512 tokens.

The model is a random Llama (4 layers, d_model 64, 4 heads / 2 key-value heads, d_mlp 256, a 500-word word-level
tokenizer) saved by transformers, with per-layer ReLU transcoders of 256 features in circuit-tracer's format
(``attribution_child.py make``); both tools run with ``max_n_logits=10, desired_logit_prob=0.95, batch_size=32,
max_feature_nodes=1024``. Each measurement is a process of its own (``attribution_child.py``): ours in the
project's venv, circuit-tracer (its nnsight backend) in the reference venv ``/work/ref-venv``
(``/work/shared/REFERENCES.md``) when it exists, otherwise reported as not measured. Only the ``attribute`` call
is timed, after one warm-up call on the prompt's first 8 tokens in the same process (the first gradient call of a
process makes torch import sympy, 3 s here, which circuit-tracer's imports have already paid); ``attribution_MiB`` is the process's peak resident memory minus its resident memory just before the
call (model and transcoders loaded). Both run with one thread (``OMP_NUM_THREADS=1``): on a shared 2-core machine
two spinning threads per process make small matmuls 20x slower and the times noise. Contenders are interleaved
(ours, circuit-tracer, ours, ...).

    python tests/benchmarks/bench_attribution.py [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks.common import script_main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "attribution_child.py"
REF_PYTHON = Path(os.environ.get("WORKBENCH_REF_VENV", "/work/ref-venv")) / "bin" / "python"
LENGTHS = (32, 128, 512)
GOAL = 1.0   # at most circuit-tracer's time
REPORT_NOTES = ("\n`ratio_to_reference` is our median time over circuit-tracer's; `attribution_MiB` the memory the "
                "call added to the process (peak resident minus resident before it). circuit-tracer keeps "
                "`batch_size` copies of the prompt's frozen forward pass for the backward passes, whose attention "
                "patterns grow as batch x heads x pos^2 per layer; ours keeps as many as fit in `forward_memory` "
                "(256 MiB by default, `forward_copies`) and runs each batch of targets in as many backward passes as "
                "it needs, so that term stops growing once it reaches the budget; `plan_attribution` reports it "
                "before a run.\n")


def _child(python: Path, *args: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    result = subprocess.run([str(python), str(CHILD), *args], capture_output=True, text=True, env=env, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"{python} {CHILD.name} {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    lines = result.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def run(quick: bool = False) -> list[dict]:
    """One row per prompt length and tool; ``quick``: one repeat instead of two."""
    have_reference = REF_PYTHON.exists()
    repeats = 1 if quick else 2
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        # the files are written by the reference venv's transformers when it is there (it reads them back)
        _child(REF_PYTHON if have_reference else Path(sys.executable), "make", folder)
        for n_tokens in LENGTHS:
            runs: dict[str, list[dict]] = {"workbench": [], "circuit-tracer 0.5": []}
            for _ in range(repeats):
                runs["workbench"].append(_child(Path(sys.executable), "ours", folder, str(n_tokens)))
                if have_reference:
                    runs["circuit-tracer 0.5"].append(_child(REF_PYTHON, "reference", folder, str(n_tokens)))
            reference = statistics.median(r["seconds"] for r in runs["circuit-tracer 0.5"]) if have_reference else None
            for name, measured in runs.items():
                if not measured:
                    rows.append({"comparison": f"attribute, {n_tokens} tokens", "contender": name,
                                 "median_s": "not measured (no reference venv with circuit-tracer)"})
                    continue
                median = statistics.median(r["seconds"] for r in measured)
                ratio = median / reference if reference else ""
                rows.append({"comparison": f"attribute, {n_tokens} tokens", "contender": name, "median_s": median,
                             "min_s": min(r["seconds"] for r in measured), "repeats": len(measured),
                             "ratio_to_reference": ratio,
                             "attribution_MiB": max(r["attribution_rss"] for r in measured) / 2**20,
                             "peak_rss_MiB": max(r["peak_rss"] for r in measured) / 2**20,
                             "n_active": measured[0]["n_active"], "n_nodes": measured[0]["n_nodes"],
                             "goal_met": "" if name != "workbench" or ratio == "" else ratio <= GOAL})
    return rows


if __name__ == "__main__":
    script_main(__name__, "Attribution graphs against circuit-tracer 0.5", "one repeat instead of two")
