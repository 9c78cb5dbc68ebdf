"""Head-ablation sweep over every head: batched ``head_sweep`` vs one ``run_with_hooks`` per head.

Both contenders zero-ablate each (layer, head) of SmolLM2-135M (270 heads) on the same tokens
and return the mean next-token loss per head; the rows report their times (interleaved
repeats), the ratio, the largest difference between their results, and the weight-matrix FLOPs
each does with the rate it reached. The staircase does ~0.6x the loop's FLOPs; the rest of its
lead is running them in large matmuls, so the last column bounds what a sweep doing these FLOPs
could reach: the loop's time over the staircase's FLOPs at this machine's large-matmul rate.
``share_of_flop_bound`` is that bound's time over head_sweep's (REPORT_NOTES derives it; reported, no goal); at 128
tokens only head_sweep runs. One more 41-token sweep is split into its parts (``profile_sweep``: norms,
each projection, rotary, the attention kernel, the loss, ...) with each matmul's rate, printed under the table.

A second comparison times attribution patching over the same heads (one clean forward, one
corrupted forward, one backward) against exact head patching, and reports the Pearson
correlation between the two.

    python tests/benchmarks/bench_head_sweep.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

import workbench as wb
from experiments.ablation import head_sweep
from experiments.induction import repeated_random_tokens
from experiments.patching import attribution_patching, patch_heads
from workbench.hook_point import caching
from tests.benchmarks.common import interleaved_timings, markdown_table, matmul_probe, script_main, timing_rows

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


def staircase_tokens(model, batch: int, pos: int) -> tuple[int, int]:
    """Tokens the staircase runs through blocks (counted once per block) and through the unembedding: every
    head's B x (P - 1) positions (the last one the loss never reads) from its own layer on."""
    L, H = model.cfg.n_layers, model.cfg.n_heads
    return sum(H * batch * (pos - 1) * (L - layer) for layer in range(L)), L * H * batch * (pos - 1)


def sweep_flops(model, batch: int, pos: int) -> tuple[float, float]:
    """FLOPs of the loop (every head: a whole forward over every position) and of the staircase
    (every head: the blocks from its own layer on and the unembedding, without the last position,
    which the loss never reads)."""
    block, unembed = weight_flops_per_token(model)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    loop = L * H * batch * pos * (L * block + unembed)
    block_tokens, unembed_tokens = staircase_tokens(model, batch, pos)
    return loop, block_tokens * block + unembed_tokens * unembed


def sweep_probe(model) -> tuple[Callable[[], object], float]:
    """Ten of the sweep's largest matmul ([2048, d_model] x [d_model, d_mlp]) and their FLOPs: timed between the
    sweeps (a contender of their interleaved rounds), the rate an exact sweep could at best run at, at the same time."""
    return matmul_probe(model.cfg.d_model, model.cfg.d_mlp)


LOOP, BATCHED = "loop: one run_with_hooks per head", "head_sweep (batched)"
PROBE = "matmul probe"

REPORT_NOTES = """
**The FLOP bound** (`share_of_flop_bound`). An exact zero-ablation sweep over every head must, for each of the
L x H heads, run the blocks from the head's layer on and the unembedding over the B x (P - 1) positions the
loss reads (the last position predicts nothing; attention is causal, so no other position sees it). Per token a
block's weight matrices cost 2 x (their parameter count) FLOPs (q, k, v, o, gate, up, down: 7.08 MFLOP for
SmolLM2-135M) and the unembedding 2 x d_model x d_vocab (56.6 MFLOP). Summed over the staircase:
FLOPs = sum over layers a of H x B x (P - 1) x ((L - a) x block + unembed) (`weight_GFLOP`). Attention scores,
norms, activations and the softmax of the loss are left out (they are not matmuls against weights), so they
count against the sweep. The fastest this hardware runs such matmuls is `matmul_GFLOP_per_s`: one
[2048, d_model] x [d_model, d_mlp] matmul, the sweep's largest shape at its row count, timed ten at a time
between the sweeps of the same interleaved rounds (median). The bound is FLOPs / that rate, and
`share_of_flop_bound` is the bound over the measured median time: reported, no longer a goal on this machine
(a shared 2-core CPU, whose matmul rate moves between the probe and the sweep).
"""


def sweep_rows(model, tokens: torch.Tensor, repeats: int, with_loop: bool = True) -> list[dict]:
    """head_sweep timed (against the per-head loop, with_loop) with its FLOPs, its rate and its share of
    the FLOP bound: the staircase's weight FLOPs at this machine's large-matmul rate, probed in the same rounds."""
    results: dict[str, list[float]] = {}
    probe, probe_flops = sweep_probe(model)
    contenders = {BATCHED: lambda: results.__setitem__(BATCHED, head_sweep(model, tokens, progress=False).metric.tolist()),
                  PROBE: probe}
    if with_loop:
        contenders = {LOOP: lambda: results.__setitem__(LOOP, loop_sweep(model, tokens)), **contenders}
    times = interleaved_timings(contenders, repeats=repeats, warmup=0)
    peak_flops = probe_flops / float(np.median(times.pop(PROBE)))
    loop_flops, staircase_flops = sweep_flops(model, *tokens.shape)
    flops = {LOOP: loop_flops, BATCHED: staircase_flops}
    n_heads = model.cfg.n_layers * model.cfg.n_heads
    shape = f"{n_heads} heads, batch {tokens.shape[0]} x {tokens.shape[1]} tokens"
    extra = {}
    if with_loop:
        max_diff = float(np.abs(np.array(results[LOOP]) - np.array(results[BATCHED])).max())
        extra = {name: {"max_abs_diff_vs_loop": max_diff} for name in (LOOP, BATCHED)}
    rows = timing_rows(f"zero-ablation sweep ({shape})", times, LOOP if with_loop else BATCHED, extra=extra)
    for row in rows:
        if with_loop:
            row["speedup_vs_loop"] = 1.0 / row["ratio_to_reference"]
        row["weight_GFLOP"] = flops[row["contender"]] / 1e9
        row["GFLOP_per_s"] = flops[row["contender"]] / row["median_s"] / 1e9
    sweep = rows[-1]
    sweep["matmul_GFLOP_per_s"] = peak_flops / 1e9
    # The FLOP bound: the staircase's weight FLOPs at the large-matmul rate. Its share is reported, not held to a
    # goal: on a shared 2-core CPU the probe's rate and the sweep's time drift apart between rounds.
    sweep["share_of_flop_bound"] = (staircase_flops / peak_flops) / sweep["median_s"]
    if with_loop:  # the most an exact batched sweep could gain over the loop
        sweep["bound_speedup_at_matmul_rate"] = rows[0]["median_s"] / (staircase_flops / peak_flops)
    return rows


# Where a sweep's time goes. Every hook point inside a block notes the time it is reached; the time since
# the point before is the work between them: (the points, relative to their block; the part; the block's
# weight matrices that work multiplies by). The loss (final norm, unembedding, log-sum-exp) is timed whole.
PROFILE_PARTS = [
    (("ln1.hook_scale", "ln1.hook_normalized", "ln2.hook_scale", "ln2.hook_normalized"), "RMS norms", ()),
    (("attn.hook_q",), "q projection", ("attn._W_Q_lin",)),
    (("attn.hook_k", "attn.hook_v"), "k, v projections", ("attn._W_K_lin", "attn._W_V_lin")),
    (("attn.hook_rot_q", "attn.hook_rot_k"), "rotary (q, k)", ()),
    (("attn.hook_z",), "attention kernel (SDPA)", ()),
    (("hook_attn_out",), "o projection", ("attn._W_O_lin",)),
    (("mlp.hook_pre", "mlp.hook_pre_linear"), "gate, up projections", ("mlp._W_gate_lin", "mlp._W_in_lin")),
    (("mlp.hook_post",), "silu(gate) x up", ()),
    (("hook_mlp_out",), "down projection", ("mlp._W_out_lin",)),
    (("hook_resid_pre", "hook_resid_mid", "hook_resid_post"), "residual adds, the edits, between blocks", ()),
]
LOSS_PART = "loss: final norm, unembedding, log-sum-exp"
REST_PART = "outside blocks and loss (set-up, torch.cat, Python)"


class _PartTimer(dict):
    """A hook point's ``cache_into`` that keeps, instead of the tensor, the seconds since the point before."""

    def __init__(self, part_of_point: dict[str, str]):
        super().__init__()
        self.part_of_point, self.seconds, self.last = part_of_point, defaultdict(float), None

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.seconds[self.part_of_point[name]] += now - self.last
        self.last = time.perf_counter()  # the bookkeeping above is not counted


def profile_sweep(model, tokens: torch.Tensor, matmul_flops_per_s: float) -> list[dict]:
    """One head_sweep split into the parts of PROFILE_PARTS, each with its seconds, share of the sweep, weight
    FLOPs and their rate against ``matmul_flops_per_s``; the loss and the remainder as parts of their own."""
    L = model.cfg.n_layers
    B, P = tokens.shape
    # The unedited run's B x P tokens through every block and its B x (P - 1) through the loss, then the staircase's.
    block_tokens, unembed_tokens = staircase_tokens(model, B, P)
    token_blocks, loss_tokens = B * P * L + block_tokens, B * (P - 1) + unembed_tokens
    parameters = dict(model.blocks[0].named_parameters())
    part_of_point, gflop = {}, {LOSS_PART: 2.0 * model.unembed.W_U.numel() * loss_tokens / 1e9}
    for suffixes, part, weights in PROFILE_PARTS:
        gflop[part] = 2.0 * sum(parameters[w].numel() for w in weights) * token_blocks / 1e9 if weights else None
        for layer in range(L):
            part_of_point.update({f"blocks.{layer}.{suffix}": part for suffix in suffixes})
    timer = _PartTimer(part_of_point)
    loss_from_resid = model.loss_from_resid

    def timed_loss(*args):
        start = time.perf_counter()
        try:
            return loss_from_resid(*args)
        finally:
            timer.seconds[LOSS_PART] += time.perf_counter() - start
            timer.last = None  # the next pass starts afresh

    model.loss_from_resid = timed_loss  # an instance attribute over the method, removed below
    try:
        with caching(model.hook_dict, part_of_point.__contains__, timer):
            start = time.perf_counter()
            head_sweep(model, tokens, progress=False)
            total = time.perf_counter() - start
    finally:
        del model.loss_from_resid
    parts = [part for _, part, _ in PROFILE_PARTS] + [LOSS_PART]
    seconds = {part: timer.seconds[part] for part in parts}
    seconds[REST_PART] = total - sum(seconds.values())
    rows = []
    for part, spent in {**seconds, "whole sweep (timed by this split)": total}.items():
        row = {"part": part, "seconds": spent, "share_of_sweep": spent / total}
        if gflop.get(part):
            row.update(weight_GFLOP=gflop[part], GFLOP_per_s=gflop[part] / spent,
                       share_of_matmul_rate=gflop[part] / spent / matmul_flops_per_s * 1e9)
        rows.append(row)
    return rows


def profile_summary(rows: list[dict], matmul_flops_per_s: float) -> str:
    """The bound a sweep could reach with its matmuls at the matmul rate and its other parts as measured."""
    total = rows[-1]["seconds"]
    matmul_parts = [row for row in rows[:-1] if "weight_GFLOP" in row]
    other = sum(row["seconds"] for row in rows[:-1] if "weight_GFLOP" not in row)
    bound = sum(row["weight_GFLOP"] for row in matmul_parts) * 1e9 / matmul_flops_per_s
    matmul_seconds = sum(row["seconds"] for row in matmul_parts)
    return (f"The parts with weight matmuls took {matmul_seconds:.2f} s of {total:.2f} s: {bound:.2f} s at the probe's "
            f"rate, so they ran at {bound / matmul_seconds:.0%} of it (the loss's log-sum-exp counted with its "
            f"matmuls). The parts without any took {other:.2f} s. With every matmul at the probe's rate and the rest "
            f"as measured, the sweep would take {bound + other:.2f} s: share_of_flop_bound "
            f"{bound / (bound + other):.2f}, the most these non-matmul parts leave.")


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


_profile_report = ""  # the last run's time split, for report_notes


def report_notes() -> str:
    """What BENCHMARKS.md prints under this module's table: the bound's derivation and the last run's time split."""
    return REPORT_NOTES + _profile_report


def run(quick: bool = False) -> list[dict]:
    """Rows for BENCHMARKS.md: the sweep comparison, then attribution vs exact head patching."""
    model, label = load_model()
    started = time.perf_counter()
    rows = []
    repeats = 1 if quick else 3
    for seq_len in SEQ_LENS_QUICK if quick else SEQ_LENS:
        tokens = repeated_random_tokens(model, seq_len=seq_len, batch=1, seed=0)
        rows += sweep_rows(model, tokens, repeats)
    rate = rows[-1]["matmul_GFLOP_per_s"] * 1e9  # the longest loop-compared sweep is split into its parts
    split = profile_sweep(model, tokens, rate)
    global _profile_report
    _profile_report = (f"\n**Where the time goes** in one more {tokens.shape[1]}-token head_sweep (`profile_sweep`: "
                       "each hook point in a block notes when it is reached; the matmul rate is that sweep's "
                       f"probe's). {profile_summary(split, rate)}\n\n{markdown_table(split)}")
    if not quick:
        long_tokens = repeated_random_tokens(model, seq_len=LONG_TOKENS // 2, batch=1, seed=0)[:, :LONG_TOKENS]
        rows += sweep_rows(model, long_tokens, repeats, with_loop=False)
    if model.tokenizer is not None:
        rows += attribution_rows(model, repeats=1 if quick else 3)
    for row in rows:
        row["model"] = label
    print(f"bench_head_sweep: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return rows


if __name__ == "__main__":
    script_main(__name__, "Head-ablation sweep and attribution patching", "shorter tokens, one repeat")
