"""The model card of a zoo model (``MODEL_CARD.md``, Markdown): what it is, its corpus and training,
and the circuits ``experiments.zoo.measure`` found in it."""

from __future__ import annotations

import json
from typing import Any, Sequence

from experiments.zoo import PROBE_SEQ_LEN, PROBE_WINDOWS
from workbench.corpus import HELD_OUT_EVERY, Corpus
from workbench.model import Decoder
from workbench.train import MIN_REPEAT_LEN, TrainResult
from workbench.zoo.recipes import Recipe


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
    """MODEL_CARD.md: what the model is, what it was trained on and how, and what was measured.

    ``summary`` is the training record plus ``experiments.zoo.measure``'s facts (what metrics.json holds).

    Example (the corpus and a training run take minutes; ``experiments.cli.zoo.run_recipe`` writes the card):
        >>> text = model_card(recipe, train_cfg, corpus, result, summary, model)   # doctest: +SKIP
        >>> text.splitlines()[0]                                                 # doctest: +SKIP
        '# toy-attn-2l'
    """
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
