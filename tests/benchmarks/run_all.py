"""``make bench``: runs every comparison and writes BENCHMARKS.md.

Each comparison lives in its own script (runnable alone with ``--quick``) exposing
``run(quick) -> list[dict]``; this file runs each in a fresh process (as a user's script runs: no
setting of an earlier comparison carries over) and collects their rows into one report, with the
machine line and the goal each comparison is held to.

    python tests/benchmarks/run_all.py --out BENCHMARKS.md [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks.common import machine_line, markdown_table, module_notes

# (module, title, goal) in the order of the benchmarks issue.
COMPARISONS = [
    ("bench_forward", "1-2. Forward (no hooks) and run_with_cache",
     "forward within 1.05x of transformers sdpa; cache-all within 1.10x of it on both models and below "
     "TransformerBridge's ratio; pattern-only cache within 1.05x"),
    ("bench_generation", "2b. Greedy generation with the KV cache",
     "tokens/s at least transformers' generate (SmolLM2, prompt 32, 128 new, batch 1 and 8); a hook on every "
     "hook_resid_post at most 1.2x the unhooked time; TransformerBridge reported"),
    ("bench_head_sweep", "3. Head-ablation sweep over every head",
     "batched head_sweep at least 5x faster than one run_with_hooks per head, identical results; "
     "its share of the FLOP bound at 11, 41 and 128 tokens reported (no goal on this machine)"),
    ("bench_attention_memory", "4. Attention memory and time vs sequence length", "flash at 8,192 tokens under 10% of eager's peak memory"),
    ("bench_load", "5. Loading SmolLM2-135M from its GGUF",
     "faster than transformers; the second load in a fresh process (weights cache warm) within 1.5 s"),
    ("bench_dashboard", "6. Dashboard in a real browser (SmolLM2-135M)",
     "first plot within 5 s of launching the server (weights cache warm); a prompt change redrawn within 0.5 s "
     "(median of 5, 64 tokens) on every page whose default view runs the model; a page switch within 1 s"),
    ("bench_datasets", "8. Padded batches: masked forward, and IOI head patching over a dataset",
     "masked forward at most 1.1x the unmasked forward; IOI head patching reported against TransformerLens's "
     "get_act_patch_attn_head_out_all_pos"),
    ("bench_distributed", "9. Ray sweep throughput",
     "2 workers faster than 1 on this 2-core machine; per-GPU-worker throughput estimated in README"),
    ("bench_offload", "10. CPU + disk offload (accelerate device map)",
     "reported: the offloaded forward's time against the in-memory model, equal logits"),
    ("bench_sae", "11. SAEs: splice with the error term, training throughput (SmolLM2-135M)",
     "run_with_saes(use_error_term=True) at most 1.1x the plain forward (batch 8 x 128); the training activations "
     "no more than the forward to the hooked layer (stop_at_layer), the SAE step no more than that forward"),
    ("bench_attribution", "12. Attribution graphs against circuit-tracer 0.5",
     "attribute at most 1.0x circuit-tracer's time on the same model, transcoders and prompt (32, 128 and 512 "
     "tokens), its peak memory reported beside circuit-tracer's"),
    ("bench_circuits", "13. Circuits: EAP over IOI pairs, exact edge patching",
     "EAP at most 0.5x TransformerLens's attribution_patch (edge) time on the same pairs (an MHA model: TL refuses "
     "GQA); batched exact edge patching at least 5x one forward per edge"),
    ("bench_lenses", "14. Tuned-lens training against tuned-lens 0.2", "reported: tokens/s of both trainers side by side"),
    ("bench_steering", "15. Steering vectors: CAA training, steered generation",
     "CAA vector over N pairs reported against one cached forward per prompt to the deepest layer used; steered "
     "generation within 1.05x of plain generation"),
]
GPU_TITLE = "7. GPU: Triton FlashAttention-2 vs SDPA's flash backend; forward, cache-all and generation"
GPU_GOAL = ("Triton forward at least 0.9x and forward+backward at least 0.8x of SDPA's throughput; cache-all within "
            "1.10x of transformers' forward on the GPU; generation reported against transformers' generate")
REPO_ROOT = Path(__file__).resolve().parents[2]
RECORDED_GPU = REPO_ROOT / "tests" / "benchmarks" / "recorded" / "gpu_h200.md"
HISTORY = REPO_ROOT / "tests" / "benchmarks" / "recorded" / "history"  # <module>.md: earlier before/after records


def history_section(module_name: str) -> str:
    """The comparison's earlier measurements (before/after a fix), or nothing."""
    path = HISTORY / f"{module_name}.md"
    if not path.exists():
        return ""
    return f"\nEarlier measurements (`{path.relative_to(REPO_ROOT)}`, not measured by this run):\n\n{path.read_text()}"


def gpu_section(quick: bool) -> str:
    """The GPU's tables: measured now where CUDA is available, else the run recorded on a lent GPU."""
    import torch

    if torch.cuda.is_available():
        import contextlib
        import io

        from tests.benchmarks import bench_triton_flash

        rows, notes = run_in_fresh_process("bench_gpu", quick)
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            bench_triton_flash.main(["--graphs"] + (["--quick"] if quick else []))
        return markdown_table(rows) + notes + "\n" + buffer.getvalue()
    return ("No CUDA device on this machine, so this section is the run recorded on a lent GPU "
            f"(`{RECORDED_GPU.relative_to(REPO_ROOT)}`), not measured by this `make bench`.\n\n"
            + RECORDED_GPU.read_text() + history_section("bench_triton_flash"))


def run_in_fresh_process(module_name: str, quick: bool) -> tuple[list[dict], str]:
    """One comparison's rows and notes, measured in a process of its own, as a user's script runs: nothing an
    earlier comparison did (allocator settings, threads, imports, compiled kernels) carries over."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--one", module_name, "--json", str(out)]
        subprocess.run(command + (["--quick"] if quick else []), check=True, cwd=REPO_ROOT)
        result = json.loads(out.read_text())
    return result["rows"], result["notes"]


def _run_one(module_name: str, quick: bool, out: Path) -> None:
    """The child of ``run_in_fresh_process``: runs one comparison and writes its rows and notes as JSON."""
    module = importlib.import_module(f"tests.benchmarks.{module_name}")
    rows = module.run(quick=quick)
    as_json = lambda value: value.item() if hasattr(value, "item") else str(value)  # noqa: E731 numpy/torch scalars
    out.write_text(json.dumps({"rows": rows, "notes": module_notes(module)}, default=as_json))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="BENCHMARKS.md")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)    # run_in_fresh_process's child: one comparison
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        _run_one(args.one, args.quick, args.json)
        return
    started = time.time()
    sections = [
        "# Benchmarks\n",
        f"Machine at the start: {machine_line()}.\n",
        "Made by `make bench` (`python tests/benchmarks/run_all.py`), each comparison in a fresh process with the "
        "documented defaults (no opt-in call; a tuned mode, where one exists, has its own row). Times are seconds "
        "per call: median, min and max of interleaved repeats (A B C A B C ...); ratios are of medians to the "
        "reference named in each row, measured in the same run on the same weights.\n",
    ]
    for module_name, title, goal in COMPARISONS:
        print(f"== {title}", flush=True)
        try:
            rows, notes = run_in_fresh_process(module_name, args.quick)
            table = markdown_table(rows)
        except Exception:  # one broken comparison must not hide the others' figures
            table, notes = "Failed:\n\n```\n" + traceback.format_exc() + "```\n", ""
        print(table, flush=True)
        sections.append(f"## {title}\n\nGoal: {goal}.\n\n{table}{notes}{history_section(module_name)}")
    sections.append(f"## {GPU_TITLE}\n\nGoal: {GPU_GOAL}.\n\n{gpu_section(args.quick)}")
    sections.append(f"\nTotal benchmark time: {time.time() - started:.0f} s. Machine at the end: {machine_line()}.\n")
    Path(args.out).write_text("\n".join(sections))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
