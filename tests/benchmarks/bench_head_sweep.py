"""Head-ablation sweep over every head: batched ``head_sweep`` vs one ``run_with_hooks`` per head.

Both contenders zero-ablate each (layer, head) of SmolLM2-135M (270 heads) on the same tokens
and return the mean next-token loss per head; the rows report their times (interleaved
repeats), the ratio and the largest difference between their results. A second comparison times
attribution patching over the same heads (one clean forward, one corrupted forward, one
backward) against exact head patching, and reports the Pearson correlation between the two.

    python tests/benchmarks/bench_head_sweep.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

import workbench as wb
from experiments.ablation import head_sweep
from experiments.induction import repeated_random_tokens
from experiments.patching import attribution_patching, patch_heads
from tests.benchmarks.common import interleaved_timings, machine_line, markdown_table, timing_rows

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Mary and John went to the store, Mary gave a drink to"


def loop_sweep(model, tokens) -> list[float]:
    """The baseline: one full run_with_hooks per head, zeroing that head's hook_z."""
    losses = []
    for layer in range(model.cfg.n_layers):
        for head in range(model.cfg.n_heads):
            def zero_head(z, hook, head=head):
                z = z.clone()
                z[:, :, head] = 0
                return z
            losses.append(model.run_with_hooks(tokens, return_type="loss",
                                               fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero_head)]).item())
    return losses


def sweep_rows(model, seq_len: int, batch: int, repeats: int) -> list[dict]:
    tokens = repeated_random_tokens(model, seq_len=seq_len, batch=batch, seed=0)
    results: dict[str, list[float]] = {}
    contenders = {
        "loop: one run_with_hooks per head": lambda: results.__setitem__("loop", loop_sweep(model, tokens)),
        "head_sweep (batched)": lambda: results.__setitem__(
            "batched", head_sweep(model, tokens, progress=False).metric.tolist()),
    }
    times = interleaved_timings(contenders, repeats=repeats, warmup=0)
    max_diff = float(np.abs(np.array(results["loop"]) - np.array(results["batched"])).max())
    n_heads = model.cfg.n_layers * model.cfg.n_heads
    shape = f"{n_heads} heads, batch {batch} x {tokens.shape[1]} tokens"
    rows = timing_rows(f"zero-ablation sweep ({shape})", times, "loop: one run_with_hooks per head",
                       extra={name: {"max_abs_diff_vs_loop": max_diff} for name in contenders})
    for row in rows:
        row["speedup_vs_loop"] = 1.0 / row["ratio_to_reference"]
    return rows


def attribution_rows(model, repeats: int) -> list[dict]:
    clean, corrupt = model.to_tokens(CLEAN), model.to_tokens(CORRUPT)
    answer, wrong = model.to_single_token(" Mary"), model.to_single_token(" John")
    out: dict[str, object] = {}
    contenders = {
        "exact head patching (patch_heads, batched)": lambda: out.__setitem__(
            "exact", patch_heads(model, clean, corrupt, answer, wrong, progress=False)),
        "attribution patching over heads (approximation)": lambda: out.__setitem__(
            "approx", attribution_patching(model, clean, corrupt, answer, wrong, sites=["heads"])),
    }
    times = interleaved_timings(contenders, repeats=repeats, warmup=0)
    merged = out["exact"].merge(out["approx"][["layer", "head", "attribution"]], on=["layer", "head"])
    r = float(np.corrcoef(merged["delta"], merged["attribution"])[0, 1])
    top_exact = set(merged.nlargest(10, "delta")[["layer", "head"]].itertuples(index=False))
    top_approx = set(merged.nlargest(10, "attribution")[["layer", "head"]].itertuples(index=False))
    extra = {"pearson_r_attribution_vs_exact": r, "top10_overlap": len(top_exact & top_approx),
             "prompt_tokens": int(clean.shape[1])}
    return timing_rows("head patching, IOI prompt (' Mary' vs ' John')", times,
                       "exact head patching (patch_heads, batched)", extra={name: extra for name in contenders})


def load_model():
    try:
        return wb.load_model("smollm2-135m", attn_impl="sdpa").eval(), "SmolLM2-135M"
    except Exception as error:  # not installed: the same shapes with random weights still time the sweep
        print(f"SmolLM2 unavailable ({error}); timing a random model of its shape")
        cfg = wb.ModelConfig(n_layers=30, d_model=576, n_heads=9, n_key_value_heads=3, d_mlp=1536, d_vocab=49152,
                             n_ctx=8192, normalization="RMS", positional="rotary", act_fn="silu", gated_mlp=True,
                             tie_embeddings=True, rotary_base=100000.0)
        torch.manual_seed(0)
        return wb.Decoder(cfg).eval(), "random SmolLM2-shaped model"


def run(quick: bool = False) -> list[dict]:
    """Rows for BENCHMARKS.md: the sweep comparison, then attribution vs exact head patching."""
    model, label = load_model()
    started = time.perf_counter()
    rows = sweep_rows(model, seq_len=10 if quick else 20, batch=1, repeats=1 if quick else 3)
    if model.tokenizer is not None:
        rows += attribution_rows(model, repeats=1 if quick else 3)
    for row in rows:
        row["model"] = label
    print(f"bench_head_sweep: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter tokens, one repeat")
    args = parser.parse_args()
    rows = run(quick=args.quick)
    print(f"Machine: {machine_line()}\n")
    print(markdown_table(rows, "Head-ablation sweep and attribution patching"))


if __name__ == "__main__":
    main()
