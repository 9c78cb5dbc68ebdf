"""SAEs on SmolLM2-135M: splicing with the error term against the plain forward, and training throughput.

Contenders, timed in interleaved rounds on the same batch (8 x 128 tokens of English text):

- ``plain forward`` / ``run_with_saes(use_error_term=True)``: the full forward, and the same with the shipped
  SmolLM2 SAE spliced at its hook with the error term (outputs unchanged, its hooks fire).
- ``forward to the hooked layer``: ``model(tokens, stop_at_layer=L+1)``, the least a training step's activations
  can cost; ``training activations``: what ``train_sae`` runs for them (``run_with_cache`` with a
  ``names_filter`` and ``stop_at_layer``); ``SAE step``: one top-k training step (forward, backward, Adam) on
  the batch's 1,024 activation rows, at the shipped SAE's size.

Goals: the splice at most 1.1x the plain forward; the training activations no more than the forward
to the hooked layer, and the SAE step no more than that forward.

    python tests/benchmarks/bench_sae.py [--quick]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks.common import interleaved_timings, script_main, timing_rows  # noqa: E402

COMPARISON_SPLICE = "SmolLM2-135M, batch 8 x 128: SAE splice with error term"
COMPARISON_TRAIN = "SmolLM2-135M, batch 8 x 128: SAE training throughput"
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
    return rows


if __name__ == "__main__":
    script_main(__name__, "SAE splice and training throughput", "one timed round instead of three")
