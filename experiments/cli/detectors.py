"""``python -m experiments.detectors --model NAME --out DIR [--prompt TEXT --exclude-bos --exclude-current-token]``:
the previous-token, duplicate-token and induction detector scores of every head (``detectors.csv``/``.json``)
and the induction scores' heatmap (``detectors.html``); without ``--prompt`` they score repeated random tokens."""

from __future__ import annotations

from typing import Optional, Sequence

from experiments import _cli
from experiments.detectors import head_detector_scores, scores_table
from experiments.induction import fitting_seq_len, repeated_random_tokens
from experiments.plots.common import scores_heatmap


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Runs the command on ``argv`` (default: the process's arguments).

    Example:
        >>> import tempfile
        >>> main(["--model", "toy-attn-2l", "--out", tempfile.mkdtemp(), "--exclude-bos"])
        wrote .../detectors.csv
        wrote .../detectors.json
        wrote .../detectors.html
    """
    parser = _cli.make_parser("Previous-token, duplicate-token and induction head detector scores.", "detectors")
    parser.add_argument("--prompt", default=None, help="text to score (default: repeated random tokens)")
    parser.add_argument("--exclude-bos", action="store_true")
    parser.add_argument("--exclude-current-token", action="store_true")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    tokens = model.to_tokens(args.prompt) if args.prompt else repeated_random_tokens(model, fitting_seq_len(model, 25), batch=4)
    scores = head_detector_scores(model, tokens, exclude_bos=args.exclude_bos,
                                  exclude_current_token=args.exclude_current_token)
    table = scores_table(scores)
    fig = scores_heatmap(scores["induction"], "Induction head detector score (mul)")
    _cli.write_outputs(args.out, "detectors", table, fig,
                       {"experiment": "detectors", "model": args.model, "exclude_bos": args.exclude_bos,
                        "exclude_current_token": args.exclude_current_token})


if __name__ == "__main__":
    _cli.run_main(main)
