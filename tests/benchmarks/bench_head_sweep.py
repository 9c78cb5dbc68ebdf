"""Head-ablation sweep over every head: batched ``head_sweep`` vs one ``run_with_hooks`` per head.

Both contenders zero-ablate each (layer, head) of SmolLM2-135M (270 heads) on the same tokens
and return the mean next-token loss per head; the rows report their times (interleaved
repeats), the ratio, the largest difference between their results, and the weight-matrix FLOPs
each does with the rate it reached. The staircase does ~0.6x the loop's FLOPs; the rest of its
lead is running them in large matmuls, so the last column bounds what a sweep doing these FLOPs
could reach: the loop's time over the staircase's FLOPs at this machine's large-matmul rate.
``share_of_flop_bound`` is that bound's time over head_sweep's (REPORT_NOTES derives it); at 128
tokens only head_sweep runs.

A second comparison times attribution patching over the same heads (one clean forward, one
corrupted forward, one backward) against exact head patching, and reports the Pearson
correlation between the two.

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

# Repeated random tokens of 2 x seq_len + BOS: 11 and 41 tokens. Short prompts are where a
# per-head loop wastes most (each forward re-reads ~540 MB of weights for a few tokens). At 128
# tokens (seq_len 64, cut to 128) only head_sweep runs: the loop would take ~45 s a repeat.
SEQ_LENS, SEQ_LENS_QUICK = (5, 20), (5,)
LONG_TOKENS = 128
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


def weight_flops_per_token(model) -> tuple[float, float]:
    """Multiply-add FLOPs one token spends in one block's weight matrices, and in the unembedding.

    Attention scores and element-wise work are left out (under 2% of a block at these lengths).
    """
    block = sum(p.numel() for name, p in model.blocks[0].named_parameters() if name.split(".")[-1].startswith("_W_"))  # the weight matrices (their nn.Linear storage)
    return 2.0 * block, 2.0 * model.unembed.W_U.numel()


def sweep_flops(model, batch: int, pos: int) -> tuple[float, float]:
    """FLOPs of the loop (every head: a whole forward over every position) and of the staircase
    (every head: the blocks from its own layer on and the unembedding, without the last position,
    which the loss never reads)."""
    block, unembed = weight_flops_per_token(model)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    loop = L * H * batch * pos * (L * block + unembed)
    staircase = sum(H * batch * (pos - 1) * ((L - layer) * block + unembed) for layer in range(L))
    return loop, staircase


def matmul_rate(model, rows: int = 2048, repeats: int = 7) -> float:
    """FLOP/s of one large MLP-shaped matmul on this machine: the rate an exact sweep could at best run at."""
    x = torch.randn(rows, model.cfg.d_model)
    w = torch.randn(model.cfg.d_mlp, model.cfg.d_model)
    times = interleaved_timings({"mm": lambda: torch.nn.functional.linear(x, w)}, repeats=repeats)["mm"]
    return 2.0 * rows * model.cfg.d_model * model.cfg.d_mlp / float(np.median(times))


LOOP, BATCHED = "loop: one run_with_hooks per head", "head_sweep (batched)"

REPORT_NOTES = """
**The FLOP bound** (`share_of_flop_bound`). An exact zero-ablation sweep over every head must, for each of the
L x H heads, run the blocks from the head's layer on and the unembedding over the B x (P - 1) positions the
loss reads (the last position predicts nothing; attention is causal, so no other position sees it). Per token a
block's weight matrices cost 2 x (their parameter count) FLOPs (q, k, v, o, gate, up, down: 7.08 MFLOP for
SmolLM2-135M) and the unembedding 2 x d_model x d_vocab (56.6 MFLOP). Summed over the staircase:
FLOPs = sum over layers a of H x B x (P - 1) x ((L - a) x block + unembed) (`weight_GFLOP`). Attention scores,
norms, activations and the softmax of the loss are left out (they are not matmuls against weights), so they
count against the sweep. The fastest this hardware runs such matmuls is `matmul_GFLOP_per_s`: one
[2048, d_model] x [d_model, d_mlp] matmul, the sweep's largest shape at its row count, timed in the same run.
The bound is FLOPs / that rate, and `share_of_flop_bound` is the bound over the measured median time.
"""


def sweep_rows(model, tokens: torch.Tensor, repeats: int, peak_flops: float, with_loop: bool = True) -> list[dict]:
    """head_sweep timed (against the per-head loop, with_loop) with its FLOPs, its rate and its share of
    the FLOP bound: the staircase's weight FLOPs at this machine's large-matmul rate."""
    results: dict[str, list[float]] = {}
    contenders = {BATCHED: lambda: results.__setitem__(BATCHED, head_sweep(model, tokens, progress=False).metric.tolist())}
    if with_loop:
        contenders = {LOOP: lambda: results.__setitem__(LOOP, loop_sweep(model, tokens)), **contenders}
    times = interleaved_timings(contenders, repeats=repeats, warmup=0)
    loop_flops, staircase_flops = sweep_flops(model, *tokens.shape)
    flops = {LOOP: loop_flops, BATCHED: staircase_flops}
    n_heads = model.cfg.n_layers * model.cfg.n_heads
    shape = f"{n_heads} heads, batch {tokens.shape[0]} x {tokens.shape[1]} tokens"
    extra = {}
    if with_loop:
        max_diff = float(np.abs(np.array(results[LOOP]) - np.array(results[BATCHED])).max())
        extra = {name: {"max_abs_diff_vs_loop": max_diff} for name in contenders}
    rows = timing_rows(f"zero-ablation sweep ({shape})", times, LOOP if with_loop else BATCHED, extra=extra)
    for row in rows:
        if with_loop:
            row["speedup_vs_loop"] = 1.0 / row["ratio_to_reference"]
        row["weight_GFLOP"] = flops[row["contender"]] / 1e9
        row["GFLOP_per_s"] = flops[row["contender"]] / row["median_s"] / 1e9
    sweep = rows[-1]
    sweep["matmul_GFLOP_per_s"] = peak_flops / 1e9
    # The FLOP bound: the staircase's weight FLOPs at the large-matmul rate; the goal is 90% of it.
    sweep["share_of_flop_bound"] = (staircase_flops / peak_flops) / sweep["median_s"]
    if with_loop:  # the most an exact batched sweep could gain over the loop
        sweep["bound_speedup_at_matmul_rate"] = rows[0]["median_s"] / (staircase_flops / peak_flops)
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
    wb.keep_freed_memory()  # as the docs advise for sweeps: ~1.1M page faults fewer per 41-token sweep here
    model, label = load_model()
    started = time.perf_counter()
    peak = matmul_rate(model)
    rows = []
    repeats = 1 if quick else 3
    for seq_len in SEQ_LENS_QUICK if quick else SEQ_LENS:
        tokens = repeated_random_tokens(model, seq_len=seq_len, batch=1, seed=0)
        rows += sweep_rows(model, tokens, repeats, peak)
    if not quick:
        long_tokens = repeated_random_tokens(model, seq_len=LONG_TOKENS // 2, batch=1, seed=0)[:, :LONG_TOKENS]
        rows += sweep_rows(model, long_tokens, repeats, peak, with_loop=False)
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
