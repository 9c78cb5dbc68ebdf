"""Prints the parity table: every family test module's config variants, built and saved by
transformers, loaded by us, and the max |logit difference| from transformers' eager run under
each attention kernel (float32).

    python -m tests.integration.parity_table > /tmp/parity.md
    python -m tests.integration.parity_table test_family_moe     # one family module only
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

from tests.integration.family_parity import KERNELS, logit_differences, save_case

FAMILY_MODULES = ("test_family_llama", "test_family_neox", "test_family_gemma", "test_family_phi",
                  "test_family_opt_bloom", "test_family_moe", "test_family_older", "test_family_modern",
                  "test_family_moe_more", "test_family_llama4", "test_family_minicpm3", "test_family_dbrx",
                  "test_family_diffllama")


def main(modules: tuple[str, ...] = FAMILY_MODULES) -> None:
    """Builds every case of every family module (or of ``modules``) and prints one markdown row per case."""
    print("| family module | case | architecture | " + " | ".join(KERNELS) + " |")
    print("|---|---|---|" + "---|" * len(KERNELS))
    worst = 0.0
    for module_name in modules:
        cases = importlib.import_module(f"tests.integration.{module_name}").CASES
        for name, case in cases.items():
            with tempfile.TemporaryDirectory() as directory:
                saved = save_case(name, case, Path(directory))
                differences = logit_differences(saved)
            worst = max(worst, *differences.values())
            architecture = type(saved.hf_model).__name__
            cells = " | ".join(f"{differences[kernel]:.1e}" for kernel in KERNELS)
            print(f"| {module_name.removeprefix('test_family_')} | {name} | {architecture} | {cells} |", flush=True)
    print(f"\nworst: {worst:.1e} (tolerance 1e-4)")


if __name__ == "__main__":
    main(tuple(sys.argv[1:]) or FAMILY_MODULES)
