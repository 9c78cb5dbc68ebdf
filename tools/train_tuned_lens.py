"""Trains a tuned lens for a registered model on the corpus it was trained on, with checkpoints and resume.

    nice -n 10 python tools/train_tuned_lens.py --model smollm2-135m --init least_squares --tokens 16384 \
        --checkpoint-dir /work/train/lenses/smollm2-135m --out workbench/zoo/smollm2-135m/lenses/smollm2-135m-tuned-lens

Runs on one thread (``torch.set_num_threads(1)``). Training windows are the model's corpus's train split
(``experiments.corpus_windows.bundled_windows``); the same command run again resumes from the checkpoint. At the end
the translators are written in tuned-lens 0.2's format (``--dtype float16`` halves the file) with
``training_log.csv`` and ``recipe.json`` beside them.

The learning rate defaults by the start: 1e-3 (AdamW) from the identity, 3e-5 from a least-squares fit. From the
least-squares start, 1e-3 threw SmolLM2's translators off at the second step (train KL 0.6 -> 12 nats, still 4.6 after
48 steps), while 2e-5 improved every layer's held-out KL (mean 2.72 -> 2.48 nats after 6,144 tokens). Those runs
predate the warm start's rescaling to the stream's RMS (``least_squares_init``), which makes a step of a given rate
relatively smaller wherever the stream's RMS exceeds 1: SmolLM2's reaches 31, Gemma 3's 1,350: Gemma's lens trained
at 1e-4 from the rescaled start (its card). The card's KL-by-layer figures come from ``python -m experiments.lenses``
(held-out text).
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--checkpoint-dir", required=True, type=Path)
    parser.add_argument("--tokens", type=int, default=6144)
    parser.add_argument("--tokens-per-step", type=int, default=128)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--n-windows", type=int, default=512)
    parser.add_argument("--lr", type=float, default=None,
                        help="AdamW's peak rate (default 1e-3 from the identity, 3e-5 from --init least_squares)")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", default="float32", choices=["float32", "bfloat16"],
                        help="bfloat16: the lens under bfloat16 autocast, as tuned-lens trains (fast on CPUs with bf16 units)")
    parser.add_argument("--init", default="identity", choices=["identity", "least_squares"])
    parser.add_argument("--init-tokens", type=int, default=2048)
    parser.add_argument("--ridge", type=float, default=1e-3)
    parser.add_argument("--export-checkpoint", action="store_true",
                        help="write the lens as the last checkpoint has it (a run stopped early) instead of training")
    args = parser.parse_args(argv)
    if args.lr is None:
        args.lr = 3e-5 if args.init == "least_squares" else 1e-3

    import torch

    torch.set_num_threads(args.threads)
    import workbench as wb
    from experiments.corpus_windows import bundled_windows, default_corpus
    from experiments.lenses import train_tuned_lens

    model = wb.load_model(args.model)
    corpus = default_corpus(model)
    windows = bundled_windows(model, n_windows=args.n_windows, window=args.window, corpus=corpus)
    started = time.time()
    if args.export_checkpoint:
        from experiments.lenses import lens_from_checkpoint

        lens = lens_from_checkpoint(model, args.checkpoint_dir)
    else:
        lens = train_tuned_lens(model, windows, tokens=args.tokens, tokens_per_step=args.tokens_per_step,
                                batch_windows=1, window=args.window, optimizer=args.optimizer, lr=args.lr,
                                checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                                progress=True, init=args.init, init_tokens=args.init_tokens,
                                ridge=args.ridge, precision=args.precision)
    seconds = time.time() - started
    lens.config.base_model_name_or_path = args.model  # the registered name (cfg.model_name is a GGUF's own title)
    lens.to(getattr(torch, args.dtype)).save(args.out)
    if lens.log:
        with open(args.out / "training_log.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(lens.log[0]))
            writer.writeheader()
            writer.writerows(lens.log)
    recipe = {"model": args.model, "corpus": corpus, "split": "train", "windows": list(windows.shape),
              "tokens": lens.log[-1]["tokens"] if lens.log else 0, "steps": len(lens.log), "planned_tokens": args.tokens,
              "tokens_per_step": args.tokens_per_step,
              "optimizer": args.optimizer, "lr": args.lr, "weight_decay": 1e-3, "schedule": "linear warmup, linear decay",
              "loss": "KL(final || lens), summed over layers", "init": args.init, "init_tokens": args.init_tokens if args.init == "least_squares" else 0,
              "ridge": args.ridge if args.init == "least_squares" else None,
              "precision": args.precision, "dtype": args.dtype, "threads": args.threads, "seconds_this_run": round(seconds, 1)}
    (args.out / "recipe.json").write_text(json.dumps(recipe, indent=2))
    print(json.dumps(recipe))


if __name__ == "__main__":
    main()
