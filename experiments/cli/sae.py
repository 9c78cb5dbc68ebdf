"""``python -m experiments.sae cache|train|evaluate|bench``: activations to disk, SAE / transcoder training, evaluation.

- ``cache --model M --hook H --data D --out DIR [--windows N --chunk 128]``: the data's 128-token windows, shuffled
  (seed 0; ``windows.pt``), then their activations at ``H`` (only the layers up to it run) written chunk by chunk
  into ``DIR/chunk-NNN`` (``run_with_cache(..., cache_dir=...)``): an interrupted run keeps its finished chunks.
- ``train --model M --hook H --data D --out DIR [--architecture topk --d-sae 4096 --k 32 --hook-out H2 --skip
  --cache DIR --training-tokens N --matryoshka-widths 128,512 --use-matryoshka-aux-loss ...]``: ``train_sae``;
  with ``--cache`` the activations are read from a ``cache`` directory (its windows are the data). ``--clt``
  trains a cross-layer transcoder (``train_clt``).
- ``evaluate --model M --sae DIR_OR_NAME --data D --out DIR [--windows N]``: ``evaluate_sae``, written as
  ``sae_eval.json`` / ``.csv`` / ``.html`` (the feature-density histogram).

- ``bench --model M --sae A --sae B ... --out DIR [--measures core,sparse_probing,absorption --data D --tokens N
  --seeds 3 --tasks language,code_vs_prose --per-class 200 --max-words 1500]``: ``run_bench``'s SAEBench measures
  of each SAE over seeds 0..N-1 (``experiments.sae.bench``), written as ``DIR/core.csv`` (core alone) or
  ``DIR/bench.csv`` and printed.

``--data``: ``english`` / ``english-held-out`` (``experiments.datasets.english``: the training and held-out
documents of the Debian packages ``fortunes`` and ``debian-handbook``), ``stdlib`` / ``stdlib-held-out`` (the
zoo models' corpus, ``workbench.corpus``), or a text file / directory of ``.txt``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch

from experiments import _cli
from experiments.datasets.corpus import corpus_windows
from experiments.sae.bench import core_metrics, run_bench
from experiments.sae.bench.sparse_probing import TASKS as SPARSE_PROBING_TASKS
from experiments.sae.clt import train_clt
from experiments.sae.evaluate import evaluate_sae
from experiments._depth import stop_at_layer_for
from experiments.sae.train import TrainSAEConfig, train_sae
from workbench.sae import load_sae

WINDOW = 128
COMMANDS = {"cache": "write a model's activations at a hook to disk",
            "train": "train an SAE or a transcoder on a model's activations",
            "evaluate": "an SAE's L0, explained variance and loss recovered on held-out text",
            "bench": "SAEBench's core measures of several SAEs, with their spread over seeds"}


def data_windows(model, data: str, n_windows: Optional[int] = None, seed: int = 0) -> torch.Tensor:
    """``--data``'s 128-token windows in a seeded random order, the first ``n_windows`` of them. With
    ``n_windows`` the documents are taken in a seeded random order and only as many as give that many windows
    (at an assumed 6 characters a token, then all if too few) are tokenized.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "a.txt"; _ = path.write_text("The cat sat on the mat. " * 200)
        >>> data_windows(model, str(path), n_windows=3).shape
        torch.Size([3, 128])
    """
    if data in ("english", "english-held-out"):
        from experiments.datasets.english import english_documents

        source = english_documents("train" if data == "english" else "held_out")
    elif data in ("stdlib", "stdlib-held-out"):  # the zoo models' own corpus (workbench.corpus)
        from workbench.corpus import stdlib_corpus

        corpus = stdlib_corpus()
        source = [f.text for f in (corpus.train if data == "stdlib" else corpus.held_out) if f.text.strip()]
    else:
        source = data
    generator = torch.Generator().manual_seed(seed)
    if n_windows is not None and isinstance(source, list):
        order = torch.randperm(len(source), generator=generator).tolist()
        chosen, chars = [], 0
        for index in order:
            chosen.append(source[index])
            chars += len(source[index])
            if chars >= n_windows * WINDOW * 6:
                break
        source = chosen
    windows = corpus_windows(model, source, window=WINDOW).cpu()
    order = torch.randperm(windows.shape[0], generator=generator)
    return windows[order][:n_windows]


def _usage() -> str:
    commands = "\n".join(f"  {name:<9} {purpose}" for name, purpose in COMMANDS.items())
    return (f"usage: python -m experiments.sae {{{','.join(COMMANDS)}}} ...\n\n{commands}\n\n"
            "python -m experiments.sae COMMAND --help: that command's options")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Runs ``cache``, ``train``, ``evaluate`` or ``bench`` on ``argv`` (``--help``: the commands).

    Example:
        >>> import tempfile, pathlib
        >>> text = pathlib.Path(tempfile.mkdtemp()) / "a.txt"; _ = text.write_text("The cat sat on the mat. " * 400)
        >>> out = tempfile.mkdtemp()
        >>> main(["train", "--model", "toy-attn-2l", "--hook", "blocks.0.hook_resid_post", "--data", str(text),
        ...       "--out", out, "--d-sae", "32", "--k", "4", "--training-tokens", "1024", "--batch-tokens", "256",
        ...       "--buffer-tokens", "512", "--no-progress"])
        wrote .../cfg.json
        >>> main(["evaluate", "--model", "toy-attn-2l", "--sae", out, "--data", str(text), "--out", out, "--no-progress"])
        wrote .../sae_eval.csv
        wrote .../sae_eval.json
        wrote .../sae_eval.html
    """
    argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    if argv[:1] in (["-h"], ["--help"]):
        print(_usage())
        raise SystemExit(0)
    if not argv or argv[0] not in COMMANDS:
        raise SystemExit(f"{_usage()}\n(got {argv[:1]})")
    command, rest = argv[0], argv[1:]
    if command == "bench":
        return bench(rest)
    parser = _cli.make_parser(f"SAE {command}", f"sae {command}")
    parser.add_argument("--data", required=True, help="english, english-held-out, stdlib, stdlib-held-out, or a text "
                        "file / directory")
    parser.add_argument("--windows", type=int, default=None, help="use only the first N shuffled windows")
    if command == "evaluate":
        parser.add_argument("--sae", required=True, help="an SAE directory or a shipped SAE's name")
        parser.add_argument("--batch-size", type=int, default=8)
        args = parser.parse_args(rest)
        return _evaluate(args)
    parser.add_argument("--hook", required=False, help="the hook the SAE reads (its input)")
    if command == "cache":
        parser.add_argument("--chunk", type=int, default=128, help="windows per cache directory")
        parser.add_argument("--batch-size", type=int, default=16)
        return _cache(parser.parse_args(rest))
    parser.add_argument("--hook-out", default=None, help="a transcoder's target hook")
    parser.add_argument("--skip", action="store_true", help="a skip transcoder (W_skip)")
    parser.add_argument("--clt", action="store_true", help="a cross-layer transcoder over every MLP")
    parser.add_argument("--architecture", default="topk")
    parser.add_argument("--d-sae", type=int, default=4096)
    parser.add_argument("--k", type=float, default=32)
    parser.add_argument("--cache", default=None, help="a directory written by the cache command")
    parser.add_argument("--training-tokens", type=int, default=TrainSAEConfig.training_tokens)
    parser.add_argument("--batch-tokens", type=int, default=TrainSAEConfig.train_batch_size_tokens)
    parser.add_argument("--buffer-tokens", type=int, default=TrainSAEConfig.buffer_tokens)
    parser.add_argument("--lr", type=float, default=TrainSAEConfig.lr)
    parser.add_argument("--lr-decay-steps", type=int, default=0)
    parser.add_argument("--l1-coefficient", type=float, default=TrainSAEConfig.l1_coefficient)
    parser.add_argument("--l0-coefficient", type=float, default=TrainSAEConfig.l0_coefficient)
    parser.add_argument("--dead-feature-window", type=int, default=TrainSAEConfig.dead_feature_window)
    parser.add_argument("--matryoshka-widths", type=_widths, default=(), help="matryoshka_batchtopk's levels, "
                        "comma-separated (e.g. 128,512; --d-sae is added as the last)")
    parser.add_argument("--use-matryoshka-aux-loss", action="store_true", help="matryoshka_batchtopk: one aux-k loss "
                        "per level, each level's dead features reconstructing the residual of the levels up to it")
    parser.add_argument("--outlier-norm-ratio", type=float, default=None,
                        help="leave out activations with norm above this many times the median")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--save-dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    args = parser.parse_args(rest)
    _train(args)


def _widths(text: str) -> tuple[int, ...]:
    """``--matryoshka-widths``'s comma-separated whole numbers (``train_sae`` checks them against ``--d-sae``)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers such as 128,512, got {text!r}") from None


def _cache(args: argparse.Namespace) -> None:
    model = _cli.load(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    windows = data_windows(model, args.data, args.windows)
    torch.save(windows, out / "windows.pt")
    for number, start in enumerate(range(0, windows.shape[0], args.chunk)):
        folder = out / f"chunk-{number:03d}"
        if (folder / "index.json").is_file():
            continue  # finished by an earlier run
        model.run_with_cache(windows[start:start + args.chunk], names_filter=args.hook, return_type=None,
                             stop_at_layer=stop_at_layer_for(model, [args.hook]), batch_size=args.batch_size,
                             cache_dir=folder, progress=not args.no_progress)
        print(f"wrote {folder}")


def cached_windows(cache: Path) -> tuple[torch.Tensor, list[Path]]:
    """The windows of a ``cache`` directory's finished chunks, and those chunks.

    Example:
        >>> import tempfile
        >>> cached_windows(Path(tempfile.mkdtemp()))
        Traceback (most recent call last):
        SystemExit: --cache ...: no finished chunk (run the cache command first)
    """
    chunks = sorted(p for p in cache.glob("chunk-*") if (p / "index.json").is_file())
    if not chunks:
        raise SystemExit(f"--cache {cache}: no finished chunk (run the cache command first)")
    rows = sum(json.loads((p / "index.json").read_text())["rows"] for p in chunks)
    return torch.load(cache / "windows.pt", weights_only=True)[:rows], chunks


def _train(args: argparse.Namespace) -> None:
    model = _cli.load(args)
    if args.cache:
        tokens, chunks = cached_windows(Path(args.cache))
    else:
        tokens, chunks = data_windows(model, args.data, args.windows), None
    cfg = TrainSAEConfig(training_tokens=args.training_tokens, train_batch_size_tokens=args.batch_tokens,
                         buffer_tokens=args.buffer_tokens, lr=args.lr, lr_decay_steps=args.lr_decay_steps,
                         l1_coefficient=args.l1_coefficient, l0_coefficient=args.l0_coefficient,
                         dead_feature_window=args.dead_feature_window, checkpoint_every=args.checkpoint_every,
                         outlier_norm_ratio=args.outlier_norm_ratio, matryoshka_widths=args.matryoshka_widths,
                         use_matryoshka_aux_loss=args.use_matryoshka_aux_loss)
    k = int(args.k) if args.architecture == "topk" else args.k
    common = dict(config=cfg, activation_cache=chunks, out=args.out, progress=not args.no_progress,
                  checkpoint_dir=Path(args.out) / "checkpoints" if args.checkpoint_every else None,
                  resume_from=args.resume_from)
    with torch.enable_grad():
        if args.clt:
            train_clt(model, tokens, d_transcoder=args.d_sae, architecture=args.architecture, k=k, **common)
            print(f"wrote {Path(args.out) / 'transcoders.json'}")
            return
        train_sae(model, args.hook, tokens, args.architecture, d_sae=args.d_sae, k=k, hook_name_out=args.hook_out,
                  skip=args.skip, save_dtype=args.save_dtype, **common)
    print(f"wrote {Path(args.out) / 'cfg.json'}")


def _evaluate(args: argparse.Namespace) -> None:
    model = _cli.load(args)
    sae = load_sae(args.sae, dtype="float32")  # a shipped SAE may be stored in float16
    metrics = evaluate_sae(model, sae, data_windows(model, args.data, args.windows), batch_size=args.batch_size,
                           progress=not args.no_progress)
    density = metrics.pop("feature_density")
    table = pd.DataFrame([{name: value for name, value in metrics.items()}])
    log_density = torch.log10(density.clamp_min(1e-10)).tolist()
    figure = go.Figure(go.Histogram(x=log_density, nbinsx=50))
    figure.update_layout(title="Feature density (log10 of the fraction of tokens a feature fires on; -10: dead)",
                         xaxis_title="log10 density", yaxis_title="features")
    summary = {"model": args.model, "sae": args.sae, "data": args.data, "windows": args.windows, **metrics}
    _cli.write_outputs(args.out, "sae_eval", table, figure, summary)


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
    parser.add_argument("--measures", default="core", help="comma-separated SAEBench measures: core, "
                        "sparse_probing, absorption")
    parser.add_argument("--tasks", default=",".join(SPARSE_PROBING_TASKS), help="sparse probing's labelled tasks "
                        "(comma-separated: language, code_vs_prose, handbook_chapter)")
    parser.add_argument("--per-class", type=int, default=200, help="sparse probing: texts per class")
    parser.add_argument("--max-words", type=int, default=1500, help="absorption: words of the tokenizer")
    parser.add_argument("--quiet", action="store_true", help="do not print the table")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.tokens < 1:
        parser.error(f"--seeds and --tokens must be at least 1, got {args.seeds} and {args.tokens}")
    measures = tuple(m.strip() for m in args.measures.split(",") if m.strip())
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    model = _cli.load(args)
    saes = {name: load_sae(name, dtype="float32") for name in args.sae}  # a shipped SAE may be stored in float16
    pool = data_windows(model, args.data, POOL_FACTOR * math.ceil(args.tokens / WINDOW)) if "core" in measures else None
    table = run_bench(model, saes, pool, measures=measures, seeds=tuple(range(args.seeds)), n_tokens=args.tokens,
                      batch_size=args.batch_size, progress=not args.no_progress, tasks=tasks,
                      per_class=args.per_class, max_words=args.max_words)
    figure = go.Figure()
    for name, sae in (saes.items() if "core" in measures else ()):  # cached: no forward pass
        histogram = core_metrics(model, sae, pool, seeds=tuple(range(args.seeds)), n_tokens=args.tokens,
                                 batch_size=args.batch_size, progress=False).attrs["feature_density_histogram"]
        edges = histogram["edges"]
        figure.add_bar(x=[(lo + hi) / 2 for lo, hi in zip(edges, edges[1:])], y=histogram["counts"][0], name=name)
    figure.update_layout(title="Feature density (log10 of the fraction of kept tokens a feature fires on; seed 0; "
                         "-10: dead)", xaxis_title="log10 density", yaxis_title="features", barmode="overlay")
    summary = {"model": args.model, "saes": args.sae, "data": args.data, "tokens": args.tokens, "seeds": args.seeds,
               "measures": list(measures)}
    _cli.write_outputs(args.out, "core" if measures == ("core",) else "bench", table, figure, summary)
    if not args.quiet:
        with pd.option_context("display.max_rows", None, "display.width", 160):
            print(table[["sae", "measure", "value", "std"]].to_string(index=False))
    return table
