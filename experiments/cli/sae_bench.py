"""``python -m experiments.sae bench``: SAEBench's core measures of several SAEs, with their spread over seeds.

``bench --model M --sae A --sae B ... --out DIR [--data D --tokens N --seeds 3 --batch-size 8]``: each ``--sae``
(a directory or a shipped SAE's name) through ``experiments.sae.bench.run_bench`` on ``--data``'s 128-token windows
(a pool of four times the windows one seed needs, so seeds draw different samples), seeds ``0 .. N-1``; writes
``DIR/core.csv`` (one row per SAE x measure: value, std, per-seed values), ``core.json`` and ``core.html`` (the
feature-density histograms), and prints the table.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import pandas as pd
import plotly.graph_objects as go

from experiments import _cli
from experiments.cli.sae import WINDOW, data_windows
from experiments.sae.bench import core_metrics, run_bench
from workbench.sae import load_sae

POOL_FACTOR = 4  # the pool holds this many times the windows one seed evaluates


def bench(argv: Optional[Sequence[str]] = None) -> pd.DataFrame:
    """Runs the ``bench`` command on ``argv``; returns the table it wrote.

    Example:
        >>> import tempfile, pathlib
        >>> text = pathlib.Path(tempfile.mkdtemp()) / "a.txt"; _ = text.write_text("The cat sat on the mat. " * 400)
        >>> sae_dir = tempfile.mkdtemp()
        >>> _ = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=4,
        ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.zeros(128, 4),
        ...     "W_dec": torch.zeros(4, 128), "b_enc": torch.zeros(4), "b_dec": torch.zeros(128)}).save_model(sae_dir)
        >>> table = bench(["--model", "toy-attn-2l", "--sae", sae_dir, "--data", str(text), "--out", tempfile.mkdtemp(),
        ...                "--tokens", "128", "--seeds", "1", "--no-progress", "--quiet"])
        wrote .../core.csv
        wrote .../core.json
        wrote .../core.html
        >>> float(table.set_index("measure").loc["l0", "value"])
        0.0
    """
    parser = _cli.make_parser("SAEBench core measures of several SAEs", "sae bench")
    parser.add_argument("--sae", action="append", required=True, help="an SAE directory or a shipped SAE's name "
                        "(repeat for several)")
    parser.add_argument("--data", default="english-held-out", help="english, english-held-out, stdlib, "
                        "stdlib-held-out, or a text file / directory")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens each seed evaluates")
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds (0 .. N-1)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--quiet", action="store_true", help="do not print the table")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.tokens < 1:
        parser.error(f"--seeds and --tokens must be at least 1, got {args.seeds} and {args.tokens}")
    model = _cli.load(args)
    saes = {name: load_sae(name, dtype="float32") for name in args.sae}  # a shipped SAE may be stored in float16
    pool = data_windows(model, args.data, POOL_FACTOR * math.ceil(args.tokens / WINDOW))
    table = run_bench(model, saes, pool, seeds=tuple(range(args.seeds)), n_tokens=args.tokens,
                      batch_size=args.batch_size, progress=not args.no_progress)
    figure = go.Figure()
    for name, sae in saes.items():  # cached: the histograms come back without a forward pass
        histogram = core_metrics(model, sae, pool, seeds=tuple(range(args.seeds)), n_tokens=args.tokens,
                                 batch_size=args.batch_size, progress=False).attrs["feature_density_histogram"]
        edges = histogram["edges"]
        figure.add_bar(x=[(lo + hi) / 2 for lo, hi in zip(edges, edges[1:])], y=histogram["counts"][0], name=name)
    figure.update_layout(title="Feature density (log10 of the fraction of kept tokens a feature fires on; seed 0; "
                         "-10: dead)", xaxis_title="log10 density", yaxis_title="features", barmode="overlay")
    summary = {"model": args.model, "saes": args.sae, "data": args.data, "tokens": args.tokens, "seeds": args.seeds}
    _cli.write_outputs(args.out, "core", table, figure, summary)
    if not args.quiet:
        with pd.option_context("display.max_rows", None, "display.width", 160):
            print(table[["sae", "measure", "value", "std"]].to_string(index=False))
    return table
