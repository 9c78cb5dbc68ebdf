"""``python -m experiments.induction --model NAME --out DIR [--seq-len 50 --batch 10 --seed 0]``: induction
scores on repeated random tokens (``induction.csv``/``.json``/``.html``, top heads first) and the loss on
each copy (``induction_loss.*``); with ``--workers``/``--ray-address`` the sequences are shared between Ray
workers and averaged."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from experiments import _cli
from experiments.induction import (induction_loss, induction_loss_per_prompt, induction_per_prompt, induction_scores,
                                   repeated_random_tokens, top_heads)
from experiments.plots.common import scores_heatmap
from experiments.plots.induction import induction_loss_figure


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Runs the command on ``argv`` (default: the process's arguments).

    Example:
        >>> import tempfile
        >>> main(["--model", "toy-attn-2l", "--out", tempfile.mkdtemp(), "--seq-len", "8", "--batch", "2",
        ...       "--no-progress"])
        wrote .../induction.csv
        wrote .../induction.json
        wrote .../induction.html
        wrote .../induction_loss.csv
        wrote .../induction_loss.json
        wrote .../induction_loss.html
    """
    parser = _cli.make_parser("Induction scores on repeated random tokens, and the loss on each copy.",
                              "induction", per_prompt=True)
    parser.add_argument("--seq-len", type=int, default=50)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = _cli.load(args)
    if _cli.sharded(args):  # per sequence, then the means over sequences
        from experiments import distributed

        tokens = repeated_random_tokens(model, args.seq_len, args.batch, args.seed)
        with _cli.worker_pool(args) as pool:
            rows = pool.run(induction_per_prompt, tokens, progress=not args.no_progress, seq_len=args.seq_len)
            loss_rows = pool.run(induction_loss_per_prompt, tokens, progress=False, seq_len=args.seq_len)
        means = distributed.mean_over_prompts(rows, ["layer", "head"])
        scores = torch.tensor(means["score"].to_numpy()).view(model.cfg.n_layers, model.cfg.n_heads)
        loss = distributed.mean_over_prompts(loss_rows, ["position", "copy"])
    else:
        scores = induction_scores(model, args.seq_len, args.batch, args.seed, progress=not args.no_progress)
        loss = induction_loss(model, args.seq_len, args.batch, args.seed)
    table = top_heads(scores, scores.numel())
    params = {"seq_len": args.seq_len, "batch": args.batch, "seed": args.seed}
    _cli.write_outputs(args.out, "induction", table, scores_heatmap(scores, "Induction score"),
                       {"experiment": "induction", "model": args.model, **params,
                        "mean_loss_by_copy": loss.groupby("copy").loss.mean().to_dict()})
    _cli.write_outputs(args.out, "induction_loss", loss, induction_loss_figure(loss),
                       {"experiment": "induction_loss", "model": args.model, **params})


if __name__ == "__main__":
    _cli.run_main(main)
