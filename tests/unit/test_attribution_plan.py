"""``plan_attribution`` against the memory ``attribute`` really takes: the peak resident memory of a subprocess
(its resident high-water mark, reset before each run, over the resident size before it) at two prompt lengths, each plan made with the number of
active features the run found. The plan is never below a run's peak and within 3x of it (measured: 1.8x and 2.0x), and the peak grows with the
prompt as the plan says (the growth planned is at least the growth measured and within 3x of it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import workbench as wb
from experiments.attribution.plan import forward_copies, plan_attribution
from workbench.errors import InputError

ROOT = Path(__file__).resolve().parents[2]

MEASURE = r"""
import json, os, resource, sys
import torch, workbench as wb
from experiments.attribution import attribute, plan_attribution
torch.manual_seed(0)
L, D, F, BATCH = 2, 64, 8, 128
model = wb.Decoder(wb.ModelConfig(n_layers=L, d_model=D, n_heads=4, d_vocab=100, n_ctx=256, act_fn="relu", d_mlp=128))
tc = wb.TranscoderSet(W_enc=[torch.randn(F, D) / 8 for _ in range(L)], b_enc=[torch.full((F,), -0.5)] * L,
    threshold=[None] * L, W_dec=[torch.randn(F, 1, D) / 8 for _ in range(L)], b_dec=torch.zeros(L, D),
    feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out")
attribute(model, tc, torch.randint(3, 100, (6,)), progress=False, batch_size=BATCH)   # warm up

def high_water_mark():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))

out = []
for n_pos in (32, 64):
    # Each run's own peak: writing 5 to clear_refs resets the peak resident size (VmHWM) to the current one, so
    # a transient of the warm-up or of the run before does not count (ru_maxrss never resets).
    open("/proc/self/clear_refs", "w").write("5")
    base = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    graph = attribute(model, tc, torch.randint(3, 100, (n_pos,)), progress=False, batch_size=BATCH)
    peak = high_water_mark() - base
    n = len(graph.active_features)
    plan = plan_attribution(model, tc, graph.n_pos, features_per_token=n / (L * (graph.n_pos - 1)), batch_size=BATCH)
    out.append({"peak": peak, "plan": plan.attrs["peak_bytes"], "n_active": n})
    del graph
print(json.dumps(out))
"""


def test_the_plan_is_near_the_measured_peak_and_grows_with_it():
    result = subprocess.run([sys.executable, "-c", MEASURE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                 "MALLOC_MMAP_THRESHOLD_": "65536",  # freed tensors leave the resident set
                                 "WORKBENCH_KEEP_FREED_MEMORY": "0"})  # and caching leaves that threshold alone
    assert result.returncode == 0, result.stderr[-2000:]
    short, long = json.loads(result.stdout.strip().splitlines()[-1])
    assert short["n_active"] > 0 and long["n_active"] > short["n_active"]
    # Measured with each run's own high-water mark, the plan is about 2x what a run adds (1.8x and 2.0x here): it
    # never plans less than the peak, and never more than 3x it; the same holds for the growth with the prompt.
    for run in (short, long):
        assert run["peak"] <= run["plan"] <= 3 * run["peak"], run
    measured, planned = long["peak"] - short["peak"], long["plan"] - short["plan"]
    assert measured <= planned <= 3 * measured, (short, long)


def _transcoders(n_layers: int, d_model: int, d_transcoder: int, cross_layer: bool = False) -> wb.TranscoderSet:
    return wb.TranscoderSet(
        W_enc=[torch.zeros(d_transcoder, d_model)] * n_layers, b_enc=[torch.zeros(d_transcoder)] * n_layers,
        threshold=[None] * n_layers, b_dec=torch.zeros(n_layers, d_model),
        W_dec=[torch.zeros(d_transcoder, n_layers - l if cross_layer else 1, d_model) for l in range(n_layers)],
        feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out")


def test_the_graph_parts_follow_the_node_count_by_hand():
    cfg = wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=50, n_ctx=64, act_fn="relu")
    tc = _transcoders(2, 16, 10)
    table = plan_attribution(cfg, tc, 11, features_per_token=3, max_n_logits=5)
    n_active = 3 * 2 * 10                     # per layer and position after the first
    n_nodes = n_active + 3 * 11 + 5          # features, errors of 2 layers and tokens, logits
    parts = dict(zip(table.part, table.bytes))
    assert (table.attrs["n_active"], table.attrs["n_nodes"]) == (n_active, n_nodes)
    assert parts["adjacency"] == 4 * n_nodes ** 2
    assert parts["sources"] == 4 * (n_active * 16 * 3 + 3 * 11 * 16) + 4 * 11 * 16   # encoder, decoder twice
    limited = dict(zip(*plan_attribution(cfg, tc, 11, features_per_token=3, max_n_logits=5, max_feature_nodes=7)
                       [["part", "bytes"]].T.values))
    n_small = 7 + 3 * 11 + 5
    assert limited["adjacency"] == 4 * n_small ** 2 + 4 * (7 + 5) * (n_active + 3 * 11 + 5)


def test_forward_memory_grows_with_batch_and_quadratically_with_the_prompt():
    cfg = wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=50, n_ctx=512, act_fn="relu")
    tc = _transcoders(2, 16, 4)
    forward = {(b, p): dict(zip(*plan_attribution(cfg, tc, p, batch_size=b)[["part", "bytes"]].T.values))["forward"]
               for b in (8, 16) for p in (256, 512)}
    assert 1.95 < forward[16, 256] / forward[8, 256] < 2.01   # nearly all of it is per copy of the prompt
    assert 2 < forward[8, 512] / forward[8, 256] <= 4   # linear terms plus the [batch, heads, pos, pos] patterns


def test_the_forward_copies_keep_a_long_prompt_within_forward_memory():
    # the tiny Llama of the parity fixtures: rotary, grouped queries (its rotary tables are built on the CPU,
    # and the plan moves them to the meta device with the rest of the model)
    model = wb.load_model(ROOT / "tests" / "fixtures" / "attribution" / "tiny_llama")
    tc = wb.load_transcoders(ROOT / "tests" / "fixtures" / "attribution" / "plt")
    n_ctx, budget = model.cfg.n_ctx, 2**22
    per_copy = dict(zip(*plan_attribution(model, tc, n_ctx, batch_size=1)[["part", "bytes"]].T.values))["forward"]
    copies = forward_copies(model, tc, n_ctx, 256, budget)
    assert copies == max(1, budget // per_copy) < 256   # as many as fit, found by hand from one copy's bytes
    capped = plan_attribution(model, tc, n_ctx, batch_size=256, forward_memory=budget)
    parts = dict(zip(*capped[["part", "bytes"]].T.values))
    assert capped.attrs["copies"] == copies and parts["forward"] <= budget
    uncapped = plan_attribution(model, tc, n_ctx, batch_size=256, forward_memory=None)
    assert uncapped.attrs["copies"] == 256 and uncapped.attrs["peak_bytes"] > capped.attrs["peak_bytes"]
    assert forward_copies(model, tc, 8, 16, budget) == 16   # a short prompt keeps batch_size copies
    with pytest.raises(InputError, match="forward_memory"):
        forward_copies(model, tc, 8, 16, 0)


def test_bad_arguments_are_named():
    cfg = wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=50, n_ctx=64, act_fn="relu")
    with pytest.raises(InputError, match="features_per_token"):
        plan_attribution(cfg, _transcoders(2, 16, 10), 8, features_per_token=11)
    with pytest.raises(InputError, match="n_tokens"):
        plan_attribution(cfg, _transcoders(2, 16, 10), 1)
    with pytest.raises(InputError, match="TranscoderSet"):
        plan_attribution(cfg, None, 8)
