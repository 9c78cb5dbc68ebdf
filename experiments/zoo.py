"""Making a zoo model end to end: corpus, tokenizer, training, measurements, model card.

Legend: L n_layers, H n_heads, E num_experts.

``python -m experiments.zoo --recipe NAME --out DIR`` (``workbench train`` runs it) trains the
recipe with ``workbench.train`` and writes, into ``DIR``: the checkpoint in our format
(config.json, model.safetensors, tokenizer.json, special_tokens.json), ``MODEL_CARD.md``,
``metrics.json`` (everything the card reports, machine readable) and ``corpus_manifest.tsv``
(every corpus file and its split). Training lives in ``workbench``; measuring a trained model
lives here, in ``experiments``, so the cards report exactly what the experiments compute.
``python -m experiments.zoo --regenerate DIR`` re-measures a shipped checkpoint and rewrites its
card and metrics from its recorded training run.

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

from experiments.ablation import AblationTarget, ablation_hooks
from experiments.attention import prev_token_share
from experiments.induction import copy_losses, induction_scores
from experiments.router import expert_load, top_expert_predictability
from workbench.bpe import train_bpe
from workbench.corpus import HELD_OUT_EVERY, Corpus, stdlib_corpus
from workbench.errors import InputError
from workbench.loading.native import load_native
from workbench.model import Decoder
from workbench.train import MIN_REPEAT_LEN, TrainResult, fixed_windows, tokenize_documents, train
from workbench.zoo.recipes import RECIPES, Recipe

PROBE_WINDOWS, PROBE_SEQ_LEN = 32, 128  # held-out windows for previous-token and expert-load measurements
INDUCTION = dict(seq_len=50, batch=16, seed=0)  # the cards' repeated random tokens (BOS first)


def measure(model: Decoder, held_out_stream: torch.Tensor) -> dict[str, Any]:
    """The circuit facts a card reports: induction / previous-token heads, ablations, expert load.

    Example:
        >>> measure(model, held_out_stream)["induction_head"]   # doctest: +SKIP
        [1, 2]
    """
    probe = fixed_windows(held_out_stream, PROBE_SEQ_LEN, PROBE_WINDOWS, bos=0)
    induction_LH = induction_scores(model, **INDUCTION)
    previous_LH = prev_token_share(model, probe)
    facts: dict[str, Any] = {"induction_scores": induction_LH.tolist(), "previous_token_scores": previous_LH.tolist()}
    if model.cfg.n_layers >= 2:
        induction_head = int(induction_LH[1].argmax())
        previous_head = int(previous_LH[0].argmax())
        induction_heads = [h for h in range(model.cfg.n_heads) if induction_LH[1, h] > 0.2] or [induction_head]
        with model.hooks(fwd_hooks=ablation_hooks(model, [AblationTarget("head", 0, previous_head)])):
            without_previous = induction_scores(model, **INDUCTION)[1, induction_head].item()
        with model.hooks(fwd_hooks=ablation_hooks(model, [AblationTarget("head", 1, h) for h in induction_heads])):
            copies_without_induction = copy_losses(model, **INDUCTION)
        facts.update({
            "induction_head": [1, induction_head],
            "previous_token_head": [0, previous_head],
            "induction_score_with_previous_token_head_ablated": without_previous,
            "layer1_induction_heads": induction_heads,
            "repeated_copy_loss": copy_losses(model, **INDUCTION),
            "repeated_copy_loss_induction_heads_ablated": copies_without_induction,
        })
    if model.cfg.is_moe:
        load = expert_load(model, probe).pivot(index="layer", columns="expert", values="token_fraction")
        facts["expert_load"] = load.values.tolist()
        facts["top_expert_predictability"] = top_expert_predictability(model, probe)
    return facts


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


MEASURED = ("induction_scores", "previous_token_scores", "induction_head", "previous_token_head",
            "induction_score_with_previous_token_head_ablated", "layer1_induction_heads", "repeated_copy_loss",
            "repeated_copy_loss_induction_heads_ablated", "expert_load", "top_expert_predictability")


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


def _has_induction_task(train_cfg) -> bool:
    return bool(train_cfg.induction_every or train_cfg.induction_warmup_steps)


def _induction_schedule(train_cfg) -> str:
    if not _has_induction_task(train_cfg):
        return "none"
    parts = []
    if train_cfg.induction_warmup_steps:
        parts.append(f"every step of the first {train_cfg.induction_warmup_steps:,}")
    if train_cfg.induction_every:
        parts.append(f"one step in {train_cfg.induction_every}" + (" after that" if parts else ""))
    return ", ".join(parts)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _per_head(scores_LH: list[list[float]]) -> str:
    return _table(["layer"] + [f"head {h}" for h in range(len(scores_LH[0]))],
                  [[layer, *row] for layer, row in enumerate(scores_LH)])


def model_card(recipe: Recipe, train_cfg, corpus: Corpus, result: TrainResult, summary: dict, model: Decoder) -> str:
    """MODEL_CARD.md: what the model is, what it was trained on and how, and what was measured."""
    final = result.final
    cfg_json = json.dumps({k: v for k, v in recipe.model.to_dict().items() if k != "device"}, indent=2)
    parts = [
        f"# {recipe.name}\n\n{recipe.summary}.\n\nLoad it with `wb.load_model(\"{recipe.name}\")` "
        f"({model.n_params:,} parameters, float32). Trained in this repository by `workbench.train`.",
        "## Reproduce\n\n```bash\n" + (summary["command"] or f"python -m experiments.zoo --recipe {recipe.name} "
                                       f"--out workbench/zoo/{recipe.name}") + "\n```\n\n"
        f"Seed {train_cfg.seed}. Measured on a shared 2-core CPU machine (torch {summary['torch_version']}, "
        f"{summary['torch_threads']} thread(s)): training loop {summary['train_seconds']} s, whole command "
        f"{summary['total_seconds']} s (of which corpus + tokenizer {summary['prepare_seconds']} s).",
        f"## Corpus\n\nThe Python {corpus.python_version} standard library's own source files at `{corpus.root}`: "
        "every `*.py`, sorted by relative path, excluding directories named `test`, `tests`, `idle_test`, "
        "`site-packages`, `__pycache__`, `encodings`, the `config-*` directory and `_sysconfigdata_*.py` "
        f"(see `workbench/corpus.py`). Held out: every {HELD_OUT_EVERY}th file of that list (5%). "
        f"{len(corpus.train)} train files ({summary['train_tokens']:,} tokens), {len(corpus.held_out)} held-out files "
        f"({summary['held_out_tokens']:,} tokens); corpus sha256 `{summary['corpus_sha256']}`. "
        "The exact files and their split: `corpus_manifest.tsv`.\n\n"
        f"Tokenizer: byte-level BPE, {model.tokenizer.vocab_size} ids, trained with `tokenizers` on the train "
        "files (`workbench/bpe.py`); `<|endoftext|>` (id 0) is BOS and EOS and is prepended by `to_tokens`.",
        "## Training\n\n" + _table(["setting", "value"], [
            ["steps", train_cfg.steps], ["batch x seq_len", f"{train_cfg.batch_size} x {train_cfg.seq_len}"],
            ["tokens seen", f"{train_cfg.tokens_seen:,}"],
            ["optimiser", f"AdamW, betas {train_cfg.betas}, weight decay {train_cfg.weight_decay} (matrices)"],
            ["learning rate", f"{train_cfg.lr} peak, {train_cfg.warmup_steps} warmup steps, cosine to "
                              f"{train_cfg.lr * train_cfg.min_lr_ratio:g}"],
            ["gradient clipping", train_cfg.grad_clip],
            ["repeated-text windows", f"{train_cfg.repeat_fraction:.0%} of each batch"],
            ["induction-task batches", _induction_schedule(train_cfg)],
            ["load-balancing loss", f"{train_cfg.aux_loss_coef} x Switch loss" if recipe.model.is_moe else "none"],
        ]) + "\n\nEach sequence is `<|endoftext|>` + consecutive tokens from a random offset of the train "
        "stream (files joined by `<|endoftext|>`)." + (
            f" In {train_cfg.repeat_fraction:.0%} of each batch the window starts with a stretch of code of random "
            f"length ({MIN_REPEAT_LEN} tokens to half the window) written twice, whose second copy is predictable only from the "
            "first." if train_cfg.repeat_fraction else "") + (
            f" Induction-task steps ({_induction_schedule(train_cfg)}) replace the code batch by the classic "
            f"induction task: {train_cfg.induction_batch} rows of `<|endoftext|>` + n uniformly random token ids + "
            f"the same ids again, n drawn per step from {'..'.join(map(str, train_cfg.induction_len_range))} so that no "
            "fixed look-back distance solves it. On code alone no induction head formed within this budget (what was tried: "
            "`workbench/zoo/recipes.py`)." if _has_induction_task(train_cfg) else ""),
        "## Results\n\n" + f"Final loss (nats/token, {train_cfg.eval_windows} fixed windows of {train_cfg.seq_len}): "
        f"**train {final['train_loss']:.3f}, held-out {final['held_out_loss']:.3f}**.\n\n"
        + _table(["step", "train loss", "held-out loss"] + (["max last-layer induction score"] if "induction" in final else []),
                 [[e["step"], e["train_loss"], e["held_out_loss"]] + ([e["induction"]] if "induction" in e else [])
                  for e in result.evals]),
        _circuits_section(summary, model),
        "## Config\n\n```json\n" + cfg_json + "\n```",
    ]
    return "\n\n".join(parts) + "\n"


def _circuits_section(summary: dict, model: Decoder) -> str:
    text = ["## Circuits (measured after training)",
            "Induction score: mean attention from each token of the second copy of 50 random tokens "
            "(16 sequences, seed 0, BOS first) to the token after its first occurrence:",
            _per_head(summary["induction_scores"]),
            f"Previous-token score: mean attention to the previous position on {PROBE_WINDOWS} held-out windows "
            f"of {PROBE_SEQ_LEN} tokens:",
            _per_head(summary["previous_token_scores"])]
    if "induction_head" in summary:
        (_, ind), (_, prev) = summary["induction_head"], summary["previous_token_head"]
        copies, ablated = summary["repeated_copy_loss"], summary["repeated_copy_loss_induction_heads_ablated"]
        text.append(
            f"Induction head L1H{ind} (score {summary['induction_scores'][1][ind]:.3f}); previous-token head L0H{prev} "
            f"(score {summary['previous_token_scores'][0][prev]:.3f}). Zero-ablating L0H{prev} (its `hook_z`) moves "
            f"L1H{ind}'s induction score to {summary['induction_score_with_previous_token_head_ablated']:.3f}.\n\n"
            f"Loss on repeated random tokens: first copy {copies['first_copy']:.3f}, second copy "
            f"{copies['second_copy']:.3f}; with layer-1 induction head(s) {summary['layer1_induction_heads']} "
            f"zero-ablated: {ablated['first_copy']:.3f} and {ablated['second_copy']:.3f}.")
    if "expert_load" in summary:
        load = summary["expert_load"]
        text.append(f"Expert load: fraction of tokens for which each expert is among the chosen "
                    f"{model.cfg.experts_per_token} ({PROBE_WINDOWS} held-out windows of {PROBE_SEQ_LEN}):\n\n"
                    + _table(["layer"] + [f"expert {e}" for e in range(len(load[0]))],
                             [[layer, *row] for layer, row in enumerate(load)]))
        predict = summary["top_expert_predictability"]
        text.append("Routing by content: accuracy of predicting a token's top expert from its token id vs from its "
                    "position alone (lookup fitted on half the windows, scored on the other half): "
                    + "; ".join(f"layer {l}: by token {t:.2f}, by position {p:.2f}"
                                for l, (t, p) in enumerate(zip(predict["by_token"], predict["by_position"]))) + ".")
    return "\n\n".join(text)


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
