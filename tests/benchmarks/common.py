"""Shared benchmark plumbing: interleaved repeats, medians, the machine line, markdown tables.

Repeats are interleaved (A B C A B C ...) so drift on a noisy machine hits every contender
alike and cancels in the ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch


def matmul_probe(d_in: int = 576, d_out: int = 1536, rows: int = 2048,
                 calls: int = 10) -> tuple[Callable[[], object], float]:
    """``calls`` float32 products [rows, d_in] x [d_in, d_out] (by default SmolLM2-135M's MLP at 2048 rows) and
    their FLOPs: a large-matmul rate of this machine at the moment it is timed."""
    x, w = torch.randn(rows, d_in), torch.randn(d_out, d_in)

    def probe() -> None:
        for _ in range(calls):
            torch.nn.functional.linear(x, w)

    return probe, calls * 2.0 * rows * d_in * d_out


def machine_line() -> str:
    """Cores, torch version, device and the CPU's float32 matmul rate now, for the top of every table (machines of
    one kind have run 2x apart from one day to the next: the rate places a run's times)."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    probe, flops = matmul_probe()
    seconds = statistics.median(interleaved_timings({"probe": probe}, repeats=5)["probe"])
    return (f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
            f"device {device}, {torch.get_num_threads()} threads, CPU float32 matmul {flops / seconds / 1e9:.0f} GFLOP/s "
            f"(SmolLM2-135M's MLP shape at 2048 rows, median of 5)")


def transformer_bridge(hf_dir: str, **hf_kwargs):
    """TransformerLens's TransformerBridge over its own HF instance (booting switches that instance to eager).

    ``hf_kwargs`` go to ``from_pretrained`` (e.g. ``gguf_file=`` and ``torch_dtype=`` for SmolLM2's GGUF).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformer_lens.model_bridge import TransformerBridge

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, **hf_kwargs).eval()
    tok_kwargs = {"gguf_file": hf_kwargs["gguf_file"]} if "gguf_file" in hf_kwargs else {}
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, **tok_kwargs)  # local files only: nothing is fetched
    return TransformerBridge.boot_transformers(hf_dir, hf_model=hf_model, tokenizer=tokenizer, device="cpu")


def interleaved_timings(contenders: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call for each contender, measured in interleaved rounds."""
    with torch.no_grad():
        for _ in range(warmup):
            for fn in contenders.values():
                fn()
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(repeats):
            for name, fn in contenders.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return times


def timing_rows(comparison: str, times: dict[str, list[float]], reference: str,
                extra: Optional[dict[str, dict]] = None) -> list[dict]:
    """One row per contender: median/min/max seconds and the ratio of medians to ``reference``."""
    ref = statistics.median(times[reference])
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        rows.append({"comparison": comparison, "contender": name, "median_s": median, "min_s": min(values),
                     "max_s": max(values), "repeats": len(values), "ratio_to_reference": median / ref,
                     "reference": reference, **(extra or {}).get(name, {})})
    return rows


def markdown_table(rows: list[dict], title: str = "") -> str:
    """Rows (dicts) as a markdown table; floats to 4 significant figures."""
    if not rows:
        return ""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def module_notes(module) -> str:
    """What BENCHMARKS.md prints under a module's table: its ``report_notes()`` (what the columns mean and what
    the run measured beside them) or its ``REPORT_NOTES``, or nothing."""
    return module.report_notes() if hasattr(module, "report_notes") else getattr(module, "REPORT_NOTES", "")


def script_main(module_name: str, title: str, quick_help: str,
                arguments: Sequence[tuple[str, dict]] = ()) -> None:
    """A benchmark script run alone: ``--quick`` (``quick_help`` says what it shortens), then the module's rows
    as one markdown table under the machine line, and its notes. ``arguments``: the script's own options, as
    (flag, ``add_argument`` keywords) pairs; each reaches ``run`` as a keyword.

    Example (at the end of a benchmark script):
        >>> if __name__ == "__main__":                                                      # doctest: +SKIP
        ...     script_main(__name__, "Greedy generation", "2 repeats instead of 5")
    """
    module = sys.modules[module_name]
    parser = argparse.ArgumentParser(description=module.__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    for flag, options in arguments:
        parser.add_argument(flag, **options)
    rows = module.run(**vars(parser.parse_args()))
    print(f"Machine: {machine_line()}\n")
    print(markdown_table(rows, title))
    print(module_notes(module))
