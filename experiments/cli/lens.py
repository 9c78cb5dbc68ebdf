"""``python -m experiments.lens --model NAME --out DIR [--prompt TEXT --target TEXT --baseline TEXT]``: the logit
lens over every layer and direct logit attribution at the last position, written as CSV, JSON and HTML.
"""

from __future__ import annotations

from typing import Optional, Sequence

from experiments import _cli
from experiments._tokens import str_tokens
from experiments.lens import direct_logit_attribution, logit_lens
from experiments.plots.lens import dla_figure, logit_lens_figure


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The logit lens and direct logit attribution of a prompt, written as CSV, JSON and HTML under ``--out``; ``argv``: the arguments (default: ``sys.argv``).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as out:
        ...     main(["--model", "toy-attn-2l", "--out", out, "--no-progress"])
        wrote ...logit_lens.csv
        ...
        wrote ...dla.html
    """
    parser = _cli.make_parser("Logit lens over every layer, and direct logit attribution at the last position.", "lens")
    parser.add_argument("--prompt", default=None)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--target", default=None, help="token text for the attribution (default: the model's top prediction)")
    parser.add_argument("--baseline", default=None, help="token text to subtract (optional)")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    tokens = _cli.prompt_tokens(model, args.prompt)
    labels = str_tokens(model, tokens[0])
    lens_df = logit_lens(model, tokens, args.top_k)
    _cli.write_outputs(args.out, "logit_lens", lens_df, logit_lens_figure(lens_df, labels),
                       {"experiment": "logit_lens", "model": args.model, "str_tokens": labels})
    target = model.to_single_token(args.target) if args.target else int(model(tokens)[0, -1].argmax())
    baseline = model.to_single_token(args.baseline) if args.baseline else None
    dla = direct_logit_attribution(model, tokens, target, baseline)
    _cli.write_outputs(args.out, "dla", dla, dla_figure(dla),
                       {"experiment": "direct_logit_attribution", "model": args.model, "target_token": target,
                        "baseline_token": baseline, "logit_diff": dla.attrs["logit_diff"]})


if __name__ == "__main__":
    _cli.run_main(main)
