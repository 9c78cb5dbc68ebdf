"""``python -m experiments.attention --model NAME --out DIR [--prompt TEXT]``: the per-head summary
(``attention.csv``/``.json``) and the layer x head grid of one prompt's patterns (``attention.html``)."""

from __future__ import annotations

from typing import Optional, Sequence

from experiments import _cli
from experiments._tokens import str_tokens
from experiments.attention import attention_patterns, head_summary
from experiments.plots.attention import pattern_grid_figure


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Runs the command on ``argv`` (default: the process's arguments).

    Example:
        >>> import tempfile
        >>> main(["--model", "toy-attn-2l", "--out", tempfile.mkdtemp(), "--prompt", "The cat sat"])
        wrote .../attention.csv
        wrote .../attention.json
        wrote .../attention.html
    """
    parser = _cli.make_parser("Attention patterns of one prompt: per-head summary and the layer x head grid.", "attention")
    parser.add_argument("--prompt", default=None, help="text to run (default: a fixed example)")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    tokens_1P = _cli.prompt_tokens(model, args.prompt)
    patterns = attention_patterns(model, tokens_1P)
    labels = str_tokens(model, tokens_1P[0])
    table = head_summary(patterns, tokens_1P[0])
    _cli.write_outputs(args.out, "attention", table, pattern_grid_figure(patterns, labels),
                       {"experiment": "attention", "model": args.model, "str_tokens": labels})


if __name__ == "__main__":
    _cli.run_main(main)
