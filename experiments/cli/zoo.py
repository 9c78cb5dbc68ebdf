"""Making a zoo model end to end: corpus, tokenizer, training, measurements, model card.

``python -m experiments.zoo --recipe NAME --out DIR`` (``workbench train`` runs it) trains the
recipe with ``workbench.train`` and writes, into ``DIR``: the checkpoint in our format
(config.json, model.safetensors, tokenizer.json, special_tokens.json), ``MODEL_CARD.md``,
``metrics.json`` (everything the card reports, machine readable) and ``corpus_manifest.tsv``
(every corpus file and its split). Training lives in ``workbench``; measuring a trained model
lives in ``experiments.zoo``, so the cards report exactly what the experiments compute; the card's
text is ``experiments.plots.zoo``. ``python -m experiments.zoo --regenerate DIR`` re-measures a
shipped checkpoint and rewrites its card and metrics from its recorded training run.

Example:
    >>> run_recipe("toy-attn-2l", "runs/toy", {"steps": 50})   # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from experiments.plots.zoo import model_card
from experiments.induction import induction_scores
from experiments.zoo import MEASURED, measure
from workbench.bpe import train_bpe
from workbench.corpus import Corpus, stdlib_corpus
from workbench.errors import InputError
from workbench.loading.native import load_native
from workbench.model import Decoder
from workbench.train import TrainResult, tokenize_documents, train
from workbench.zoo.recipes import RECIPES, Recipe


def _induction_during_training(model: Decoder) -> dict[str, float]:
    # A cheap probe (8 sequences of 40) so the card can show when the induction head formed.
    return {"induction": induction_scores(model, seq_len=40, batch=8)[-1].max().item()}


def run_recipe(name: str, out: Union[str, Path], overrides: Optional[dict[str, Any]] = None,
               max_files: Optional[int] = None, progress: bool = True,
               command: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Trains recipe ``name`` (with ``overrides`` of its TrainConfig) and writes model, card and metrics to ``out``.

    Example:
        >>> summary = run_recipe("toy-moe-2l", "runs/moe", {"steps": 20}, max_files=30)   # doctest: +SKIP
        >>> summary["final"]["held_out_loss"]                                             # doctest: +SKIP
    """
    if name not in RECIPES:
        raise InputError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    recipe = RECIPES[name]
    train_cfg = dataclasses.replace(recipe.train, **(overrides or {}))
    started = time.perf_counter()
    corpus = stdlib_corpus(max_files=max_files)
    tokenizer = train_bpe([source.text for source in corpus.train], vocab_size=recipe.model.d_vocab)
    train_stream = tokenize_documents(tokenizer, [source.text for source in corpus.train])
    held_out_stream = tokenize_documents(tokenizer, [source.text for source in corpus.held_out])
    prepared = time.perf_counter() - started

    torch.manual_seed(train_cfg.seed)
    model = Decoder(recipe.model, tokenizer=tokenizer)
    result = train(model, train_stream, held_out_stream, train_cfg, out=out, bos=tokenizer.bos_token_id,
                   progress=progress, on_eval=_induction_during_training)
    summary = {
        "recipe": name, "command": shlex.join(command) if command else None, "seed": train_cfg.seed,
        "steps": train_cfg.steps, "tokens_seen": train_cfg.tokens_seen, "final": result.final,
        "train_seconds": round(result.wall_seconds, 1), "total_seconds": round(time.perf_counter() - started, 1),
        "prepare_seconds": round(prepared, 1), "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__, "python_version": platform.python_version(),
        "corpus_sha256": corpus.sha256, "train_tokens": train_stream.numel(), "held_out_tokens": held_out_stream.numel(),
        "evals": result.evals,
    }
    return _write_card(Path(out), model, recipe, train_cfg, corpus, result, summary, held_out_stream)


def _write_card(out: Path, model: Decoder, recipe: Recipe, train_cfg, corpus: Corpus, result: TrainResult,
                record: dict[str, Any], held_out_stream: torch.Tensor) -> dict[str, Any]:
    """Measures the trained model and writes metrics.json, corpus_manifest.tsv and MODEL_CARD.md."""
    summary = {**record, **measure(model, held_out_stream)}
    (out / "metrics.json").write_text(json.dumps(summary, indent=2))
    (out / "corpus_manifest.tsv").write_text(corpus.manifest())
    (out / "MODEL_CARD.md").write_text(model_card(recipe, train_cfg, corpus, result, summary, model))
    return summary


def regenerate_card(directory: Union[str, Path], command: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Re-measures a trained zoo checkpoint and rewrites its card, metrics and manifest.

    The training record (steps, losses, timings, corpus hash) comes from the directory's
    metrics.json; every measurement is taken afresh from the checkpoint with today's
    experiments. ``command`` replaces the recorded reproduce command (for when its spelling
    changed, not the run it describes). The corpus must be the one the model was trained on.

    Example:
        >>> regenerate_card("workbench/zoo/toy-attn-2l")   # doctest: +SKIP
    """
    directory = Path(directory)
    record = {k: v for k, v in json.loads((directory / "metrics.json").read_text()).items() if k not in MEASURED}
    if command is not None:
        record["command"] = shlex.join(command)
    recipe = RECIPES[record["recipe"]]
    train_cfg = dataclasses.replace(recipe.train, steps=record["steps"], seed=record["seed"])
    corpus = stdlib_corpus()
    if corpus.sha256 != record["corpus_sha256"]:
        raise InputError(f"{directory}: this machine's corpus (sha256 {corpus.sha256[:12]}...) is not the one the "
                         f"model was trained on ({record['corpus_sha256'][:12]}...); retrain instead")
    model = load_native(directory).eval()
    held_out_stream = tokenize_documents(model.tokenizer, [source.text for source in corpus.held_out])
    result = TrainResult(evals=record["evals"], wall_seconds=record["train_seconds"])
    return _write_card(directory, model, recipe, train_cfg, corpus, result, record, held_out_stream)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """``python -m experiments.zoo``: trains a zoo recipe on the stdlib corpus and writes model + card.

    Example:
        >>> main(["--recipe", "toy-attn-2l", "--out", "runs/toy", "--steps", "50"])   # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(prog="python -m experiments.zoo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), help="which zoo model to train")
    parser.add_argument("--out", type=Path, help="directory for the checkpoint and MODEL_CARD.md")
    parser.add_argument("--regenerate", type=Path, metavar="DIR",
                        help="instead of training: re-measure the trained model in DIR and rewrite its card")
    parser.add_argument("--steps", type=int, help="override the recipe's number of steps")
    parser.add_argument("--batch-size", type=int, help="override the recipe's batch size")
    parser.add_argument("--seed", type=int, help="override the recipe's seed")
    parser.add_argument("--max-files", type=int, help="use only the first N corpus files (quick runs)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.regenerate is not None:
        return regenerate_card(args.regenerate)
    if args.recipe is None or args.out is None:
        parser.error("--recipe and --out are required (or --regenerate DIR)")
    overrides = {name: value for name, value in
                 (("steps", args.steps), ("batch_size", args.batch_size), ("seed", args.seed)) if value is not None}
    summary = run_recipe(args.recipe, args.out, overrides, max_files=args.max_files, progress=not args.no_progress,
                         command=["python", "-m", "experiments.zoo", *(argv if argv is not None else sys.argv[1:])])
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
