"""Prints the GGUF parity table: for every recipe of ``gguf_convert`` (one per llama.cpp architecture), the
max |logit difference| between our load of the float32 file and the transformers model it was written
from, and between our load of the quantised file and the transformers model holding its dequantised
weights (eager kernel, float32).

    python -m tests.integration.gguf_parity_table
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import workbench as wb
from tests.integration.gguf_convert import RECIPES, build, quantised_reference, write

TOKENS = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))


def differences(name: str, directory: Path) -> tuple[str, float, float]:
    """(transformers architecture, float difference, quantised difference) of recipe ``name``."""
    source, quant = build(name), RECIPES[name].quant
    with torch.no_grad():
        float_model = wb.load_model(write(name, source, directory / "f32.gguf"), attn_impl="eager")
        quant_model = wb.load_model(write(name, source, directory / "q.gguf", quant=quant), attn_impl="eager")
        float_diff = (float_model(TOKENS) - source(TOKENS).logits).abs().max().item()
        quant_diff = (quant_model(TOKENS) - quantised_reference(name, source, quant)(TOKENS).logits).abs().max().item()
    return type(source).__name__, float_diff, quant_diff


def main() -> None:
    print("| recipe | general.architecture | transformers model | F32 max diff | quantised type | max diff |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for name, recipe in RECIPES.items():
        with tempfile.TemporaryDirectory() as directory:
            architecture, float_diff, quant_diff = differences(name, Path(directory))
        worst = max(worst, float_diff, quant_diff)
        print(f"| {name} | `{recipe.arch}` | {architecture} | {float_diff:.1e} | {recipe.quant.name} | {quant_diff:.1e} |",
              flush=True)
    print(f"\nworst: {worst:.1e} (tolerance 1e-4)")


if __name__ == "__main__":
    main()
