"""KL and cross-entropy by layer, logit lens against a tuned lens, on a model's held-out English text, as CSV:

    python -m experiments.lenses --model smollm2-135m --lens workbench/zoo/smollm2-135m/lenses/smollm2-135m-tuned-lens \\
        [--windows 32 --window 128 --lenses logit,tuned]

Windows are ``experiments.lenses.evaluation.held_out_windows`` (``english_documents("held_out")``, never trained on);
one thread. ``--lenses`` scores only some rows (each row depends only on its own lens, so two runs on the same windows
give the table one run gives).
"""

from __future__ import annotations

import argparse
import sys

import torch

from experiments.lenses.evaluation import held_out_windows, lens_kl_by_layer
from experiments.lenses.translators import TunedLens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.lenses",
                                     description="KL and cross-entropy by layer: logit lens against a tuned lens")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lens", help="a tuned-lens folder (config.json + params.pt) or a shipped lens's name")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--lenses", default="logit,tuned", help="which rows to score: logit, tuned or both")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import workbench as wb

    model = wb.load_model(args.model)
    lens = TunedLens.load(args.lens, model) if args.lens else None
    table = lens_kl_by_layer(model, held_out_windows(model, args.windows, args.window), lens,
                             lenses=args.lenses.split(","), progress=True)
    wide = table.pivot(index="layer", columns="lens", values=["kl", "cross_entropy"])
    wide.columns = [f"{value}_{name}" for value, name in wide.columns]
    wide.round(4).to_csv(sys.stdout)


if __name__ == "__main__":
    main()
