"""DAS for IOI's name-position variable on SmolLM2-135M, layer by layer, with every control.

    nice -n 19 python tools/ioi_das_smollm2.py --prompts 96 --layers 0 8 12 16 20 24 29 --out ioi_das.csv

The variable is which name slot holds the indirect object (ABBA or BABA), intervened on in the residual stream
entering block l at each prompt's last real token (``ioi_name_position_task``); the high-level causal model says the
base then names the person in the source's slot. ``align_variable`` fits a rank-1 DAS subspace on the first three
quarters of the pairs and scores held-out interchange accuracy for DAS and its controls (arbitrary labels, a
randomly initialised copy, a norm-matched placebo, a random basis, no intervention). Prints a markdown table, writes
the CSV and, with ``--figure``, the accuracy-by-layer plot as HTML.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 8, 12, 16, 20, 24, 29])
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--figure", type=Path)
    args = parser.parse_args(argv)

    import pandas as pd
    import torch

    torch.set_num_threads(args.threads)
    import workbench as wb
    from experiments.causal import align_variable, ioi_name_position_task
    from experiments.datasets import ioi_dataset

    model = wb.load_model(args.model, progress=False).eval()
    task = ioi_name_position_task(ioi_dataset(model, args.prompts, seed=args.seed))
    frames = []
    for layer in args.layers:
        started = time.time()
        report = align_variable(model, task, f"blocks.{layer}.hook_resid_pre", rank=args.rank, epochs=args.epochs,
                                seed=args.seed)
        frame = report.table.assign(layer=layer)
        frames.append(frame)
        print(f"layer {layer}: {dict(zip(frame.subspace, frame.interchange_accuracy.round(3)))} "
              f"({time.time() - started:.0f} s)", flush=True)
    table = pd.concat(frames, ignore_index=True)
    table.to_csv(args.out, index=False)
    wide = table.pivot(index="layer", columns="subspace", values="interchange_accuracy")
    print("| layer | " + " | ".join(wide.columns) + " |")
    print("|---" * (len(wide.columns) + 1) + "|")
    for layer, row in wide.iterrows():
        print(f"| {layer} | " + " | ".join(f"{value:.3f}" for value in row) + " |")
    if args.figure:
        import plotly.express as px

        figure = px.line(table, x="layer", y="interchange_accuracy", color="subspace", markers=True,
                         title=f"IOI name position on {args.model}: held-out interchange accuracy by layer")
        figure.write_html(args.figure)


if __name__ == "__main__":
    main()
