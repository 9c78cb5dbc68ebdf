"""``python -m experiments.heads --model NAME --out DIR [--prompt TEXT] [--no-ablation]``: every per-head score for
a prompt set, with an induction heatmap and the strongest K-composition scores, written as CSV, JSON and HTML.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from experiments import _cli
from experiments.plots.common import scores_heatmap
from experiments.heads import composition_scores, head_scores_table
from experiments.induction import fitting_seq_len, repeated_random_tokens


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Every per-head score and the strongest K-composition scores, written as CSV, JSON and HTML under ``--out``; ``argv``: the arguments (default: ``sys.argv``).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as out:
        ...     main(["--model", "toy-attn-2l", "--no-ablation", "--out", out, "--no-progress"])
        wrote ...heads.csv
        ...
        wrote ...heads.html
    """
    parser = _cli.make_parser("Every per-head score for a prompt set, and K-composition scores.", "heads")
    parser.add_argument("--prompt", default=None, help="text (default: repeated random tokens)")
    parser.add_argument("--no-ablation", action="store_true", help="skip the zero-ablation sweep")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    tokens = model.to_tokens(args.prompt) if args.prompt else repeated_random_tokens(model, fitting_seq_len(model, 20), batch=2)
    table = head_scores_table(model, tokens, include_ablation=not args.no_ablation, progress=not args.no_progress)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    fig = scores_heatmap(torch.tensor(table["induction"].values).view(L, H), "Induction (mul) score")
    k_comp = composition_scores(model, "K")
    best = k_comp.flatten().topk(min(10, k_comp.numel()))
    top_k_comp = [{"from": divmod(int(i) // (L * H), H), "to": divmod(int(i) % (L * H), H), "score": float(v)}
                  for v, i in zip(best.values, best.indices)]
    _cli.write_outputs(args.out, "heads", table, fig,
                       {"experiment": "heads", "model": args.model, "top_k_composition": top_k_comp})


if __name__ == "__main__":
    _cli.run_main(main)
