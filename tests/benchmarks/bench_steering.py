"""Steering vectors on SmolLM2-135M: training a CAA vector against the forwards it needs, and steered generation
against plain generation.

Contenders, timed in interleaved rounds:

- ``train_steering_vector (CAA, N pairs)``: the vector of N contrast pairs at layers 3, 9 and 15 (deepest 15);
  ``one cached forward per prompt``: ``run_with_cache`` of each of the 2N prompts alone, stopping after layer 15,
  caching the three block outputs (the cost the vector's training should stay near; it batches the prompts, so it
  can come in under it).
- ``plain generation`` / ``steered generation``: greedy ``generate`` of 32 new tokens from a 12-token prompt,
  with the KV cache, without and with the vector applied at its three layers (multiplier 4).

Goals: the CAA ratio reported; steered generation within 1.05x of plain generation.

    python tests/benchmarks/bench_steering.py [--quick]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks.common import interleaved_timings, script_main, timing_rows  # noqa: E402

COMPARISON_TRAIN = "SmolLM2-135M: a CAA vector over N pairs against one cached forward per prompt"
COMPARISON_GENERATE = "SmolLM2-135M: greedy generation of 32 tokens, steered and plain"
LAYERS = [3, 9, 15]
SUBJECTS = ["the weather today", "my new job", "the film I saw", "this restaurant", "the long train ride",
            "our holiday by the sea", "the book you lent me", "the concert last night"]
REPORT_NOTES = ("ratio_to_reference of the CAA row is the vector's training time over 2N single-prompt cached "
                "forwards to the deepest layer used; the steered generation's is over plain generation.")


def pairs(n: int) -> list[tuple[str, str]]:
    return [(f"I loved {SUBJECTS[i % len(SUBJECTS)]}, it was wonderful",
             f"I hated {SUBJECTS[i % len(SUBJECTS)]}, it was awful") for i in range(n)]


def run(quick: bool = False) -> list[dict]:
    """Rows of both comparisons; ``quick``: 8 pairs and one timed round instead of 32 pairs and three."""
    import torch

    import workbench as wb
    from experiments.steering import train_steering_vector

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = wb.load_model("smollm2-135m", progress=False).eval()
    n_pairs = 8 if quick else 32
    repeats = 1 if quick else 3
    contrast = pairs(n_pairs)
    prompts = [model.to_tokens(text) for pair in contrast for text in pair]
    names = [f"blocks.{layer}.hook_resid_post" for layer in LAYERS]

    def one_forward_per_prompt():
        for tokens in prompts:
            model.run_with_cache(tokens, names_filter=names, stop_at_layer=max(LAYERS) + 1, return_type=None)

    train = interleaved_timings({
        "one cached forward per prompt": one_forward_per_prompt,
        f"train_steering_vector (CAA, {n_pairs} pairs)": lambda: train_steering_vector(model, contrast, layers=LAYERS),
    }, repeats)
    rows = timing_rows(COMPARISON_TRAIN, train, reference="one cached forward per prompt",
                       extra={name: {"pairs": n_pairs} for name in train})

    vector = train_steering_vector(model, contrast, layers=LAYERS)
    prompt = model.to_tokens("Tell me what you think about the weather today. I think")

    def steered():
        with vector.apply(model, multiplier=4.0):
            return model.generate(prompt, max_new_tokens=32, verbose=False)

    generate = interleaved_timings({
        "plain generation": lambda: model.generate(prompt, max_new_tokens=32, verbose=False),
        "steered generation": steered,
    }, repeats + 2)
    rows += timing_rows(COMPARISON_GENERATE, generate, reference="plain generation")
    return rows


if __name__ == "__main__":
    script_main(__name__, "Steering vectors: training and steered generation", "8 pairs and one round")
