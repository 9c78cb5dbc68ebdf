"""SAEs on SmolLM2-135M: splicing with the error term against the plain forward, and training throughput.

Contenders, timed in interleaved rounds on the same batch (8 x 128 tokens of English text):

- ``plain forward`` / ``run_with_saes(use_error_term=True)``: the full forward, and the same with the shipped
  SmolLM2 SAE spliced at its hook with the error term (outputs unchanged, its hooks fire).
- ``forward to the hooked layer``: ``model(tokens, stop_at_layer=L+1)``, the least a training step's activations
  can cost; ``training activations``: what ``train_sae`` runs for them (``run_with_cache`` with a
  ``names_filter`` and ``stop_at_layer``); ``SAE step``: one top-k training step (forward, backward, Adam) on
  the batch's 1,024 activation rows, at the shipped SAE's size.

- ``workbench`` / ``SAELens 6.54``: top-k training throughput on the same synthetic configuration and batch
  (``sae_train_child.py``: 1,024 features in 256 dimensions, d_sae 1,024, k 8, batch 1,024), each run in a fresh
  process, ours under the project's python and SAELens's ``train_toy_sae`` under the reference venv's, in
  interleaved rounds.
- ``4 SAEs from one pass`` / ``4 separate runs``: ``train_saes`` with four specs (two hooks, two widths, three
  architectures) on toy-attn-2l against ``train_sae`` run once per spec on the same data; the ratio is what one
  pass costs of the four.

Goals: the splice at most 1.1x the plain forward; the training activations no more than the forward
to the hooked layer, and the SAE step no more than that forward; our training throughput at least SAELens's
(ratio at most 1); four SAEs from one pass cheaper than four runs (ratio under 1).

    python tests/benchmarks/bench_sae.py [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks.common import interleaved_timings, script_main, timing_rows  # noqa: E402

COMPARISON_SPLICE = "SmolLM2-135M, batch 8 x 128: SAE splice with error term"
COMPARISON_TRAIN = "SmolLM2-135M, batch 8 x 128: SAE training throughput"
COMPARISON_SAELENS = "synthetic 1,024 features in 256 dims, top-k d_sae 1,024, batch 1,024: training throughput"
COMPARISON_MULTI = "toy-attn-2l: 4 SAEs from one pass against 4 separate runs"
REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "sae_train_child.py"
REF_PYTHON = Path(os.environ.get("WORKBENCH_REF_VENV", "/work/ref-venv")) / "bin" / "python"
SHIPPED = "smollm2-135m-resid14-topk"  # wb.load_sae finds it by name (wb.shipped_saes())
REPORT_NOTES = ("tokens_per_s is 1,024 tokens over the median. The SAE step's ratio is to the forward to the "
                "hooked layer, as is the training activations'.")


def run(quick: bool = False) -> list[dict]:
    """Rows of both comparisons; ``quick``: one timed round instead of three."""
    import torch

    import workbench as wb
    from experiments.datasets.corpus import corpus_windows
    from experiments.datasets.english import english_documents
    from experiments.sae.modules import TrainingSAE

    model = wb.load_model("smollm2-135m", progress=False).eval()
    sae = wb.load_sae(SHIPPED, dtype="float32")
    hook = sae.cfg.hook_name
    layer = int(hook.split(".")[1])
    tokens = corpus_windows(model, english_documents("held_out"), window=128)[:8]
    repeats = 1 if quick else 3

    splice = interleaved_timings({
        "plain forward": lambda: model(tokens),
        "run_with_saes(use_error_term=True)": lambda: model.run_with_saes(tokens, saes=[sae], use_error_term=True),
    }, repeats)
    rows = timing_rows(COMPARISON_SPLICE, splice, reference="plain forward")

    _, cache = model.run_with_cache(tokens, names_filter=hook, stop_at_layer=layer + 1, return_type=None)
    x = cache[hook][:, 1:].reshape(-1, cache[hook].shape[-1]).float()  # BOS left out, as training does
    x = torch.cat([x, x[:8]])[:1024]
    trainee = TrainingSAE("topk", x.shape[1], sae.cfg.d_sae, options={"k": sae.cfg.k or 64})
    optimizer = torch.optim.Adam(trainee.parameters(), lr=1e-4)
    dead = torch.zeros(sae.cfg.d_sae, dtype=torch.bool)
    dead[: sae.cfg.d_sae // 10] = True  # a tenth dead: the aux-k loss runs too

    def sae_step():
        with torch.enable_grad():
            out = trainee.training_forward(x, x, dead)
            out["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()

    train = interleaved_timings({
        "forward to the hooked layer": lambda: model(tokens, stop_at_layer=layer + 1),
        "training activations": lambda: model.run_with_cache(tokens, names_filter=hook, stop_at_layer=layer + 1,
                                                             return_type=None),
        "SAE step": sae_step,
        "plain forward": lambda: model(tokens),
    }, repeats)
    rows += timing_rows(COMPARISON_TRAIN, train, reference="forward to the hooked layer")
    for row in rows:
        row["tokens_per_s"] = tokens.numel() / row["median_s"]
    return rows + saelens_rows(quick) + multi_rows(quick)


def _child(python: Path, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run([str(python), str(CHILD), *args], capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        raise RuntimeError(f"{CHILD.name} {args} failed: {result.stderr[-2000:]}")
    return json.loads(lines[-1])


def saelens_rows(quick: bool = False) -> list[dict]:
    """Our top-k training against SAELens 6.54's on the same synthetic configuration, each run a fresh process
    (interleaved); a row saying why when the reference venv is missing."""
    samples, repeats = (20_480, 1) if quick else (102_400, 3)
    if not REF_PYTHON.exists():
        return [{"comparison": COMPARISON_SAELENS, "contender": "SAELens 6.54",
                 "median_s": f"not measured (no reference venv at {REF_PYTHON})"}]
    runs: dict[str, list[float]] = {"workbench": [], "SAELens 6.54": []}
    for _ in range(repeats):
        runs["workbench"].append(_child(Path(sys.executable), "ours", str(samples))["seconds"])
        runs["SAELens 6.54"].append(_child(REF_PYTHON, "saelens", str(samples))["seconds"])
    rows = timing_rows(COMPARISON_SAELENS, runs, reference="SAELens 6.54")
    for row in rows:
        row["samples_per_s"] = samples / row["median_s"]
    return rows


def multi_rows(quick: bool = False) -> list[dict]:
    """``train_saes`` with four specs against four ``train_sae`` runs on the same data (interleaved rounds)."""
    import torch

    import workbench as wb
    from experiments.sae import train_sae, train_saes

    model = wb.load_model("toy-attn-2l", progress=False).eval()
    tokens = torch.randint(1, model.cfg.d_vocab, (64 if quick else 256, 128), generator=torch.Generator().manual_seed(0))
    settings = dict(progress=False, training_tokens=tokens.numel(), train_batch_size_tokens=1024,
                    buffer_tokens=8192, exclude_special_tokens=False)
    specs = [dict(hook_name="blocks.0.hook_resid_post", architecture="topk", d_sae=512, k=16),
             dict(hook_name="blocks.0.hook_resid_post", architecture="batchtopk", d_sae=1024, k=16),
             dict(hook_name="blocks.1.hook_resid_post", architecture="topk", d_sae=512, k=16),
             dict(hook_name="blocks.1.hook_resid_post", architecture="jumprelu", d_sae=1024, k=None)]

    def separately():
        for spec in specs:
            train_sae(model, spec["hook_name"], tokens, spec["architecture"], spec["d_sae"], spec["k"], **settings)

    def together():
        train_saes(model, specs, tokens, **settings)

    times: dict[str, list[float]] = {"4 separate runs": [], "4 SAEs from one pass": []}
    for _ in range(1 if quick else 3):
        for name, fn in (("4 separate runs", separately), ("4 SAEs from one pass", together)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    rows = timing_rows(COMPARISON_MULTI, times, reference="4 separate runs")
    for row in rows:
        row["tokens_per_s"] = tokens.numel() / row["median_s"]
    return rows


if __name__ == "__main__":
    script_main(__name__, "SAE splice and training throughput", "one timed round instead of three")
