"""``python -m experiments.ioi --model NAME --out DIR [--n 200 --seed 0 --corruption swap_subject --top-k 10
--names NAME ...]``: IOI over a generated dataset; writes ``ioi_prompts``, ``ioi_logit_diff`` (per prompt) and
``ioi_head_patching`` (map and top heads) as CSV/JSON/HTML and prints the top heads. With ``--workers`` /
``--ray-address`` the prompts are shared between Ray workers."""

from __future__ import annotations

from typing import Optional, Sequence

from experiments import _cli
from experiments._tokens import str_tokens
from experiments.datasets import ioi_dataset
from experiments.ioi import ioi_patching, ioi_per_prompt, ioi_result
from experiments.plots.patching import patching_heatmap
from experiments.plots.ioi import logit_diff_figure


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Runs the command on ``argv`` (default: the process's arguments).

    Example:
        >>> import tempfile
        >>> main(["--model", "toy-attn-2l", "--out", tempfile.mkdtemp(), "--n", "2", "--top-k", "1", "--no-progress",
        ...       "--names", "man", "one", "two", "time", "they"])
        wrote .../ioi_prompts.csv
        ...
        wrote .../ioi_head_patching.html
        IOI logit difference over 2 prompts: clean -0.427, corrupted -0.248
        top heads by normalized patching effect:
         layer  head    metric     delta  normalized
             1     3 ...
    """
    parser = _cli.make_parser("IOI over a generated dataset: logit difference, head patching map, top heads.",
                              "ioi", per_prompt=True)
    parser.add_argument("--n", type=int, default=200, help="number of prompt pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corruption", default="swap_subject", choices=("swap_subject", "abc"))
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--names", nargs="+", default=None, help="names to draw (default: the single-token DEFAULT_NAMES)")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    data = ioi_dataset(model, args.n, seed=args.seed, names=args.names, corruption=args.corruption)
    if _cli.sharded(args):
        with _cli.worker_pool(args) as pool:
            rows = pool.run(ioi_per_prompt, data, progress=not args.no_progress)
        result = ioi_result(rows, args.top_k, str_tokens(model, data.clean_tokens[0]))
    else:
        result = ioi_patching(model, data, args.top_k, progress=not args.no_progress)
    summary = {"model": args.model, "n": args.n, "seed": args.seed, "corruption": args.corruption,
               "mean_logit_diff_clean": float(result.logit_diff.clean.mean()),
               "mean_logit_diff_corrupt": float(result.logit_diff.corrupt.mean()),
               "fraction_clean_positive": float((result.logit_diff.clean > 0).mean()),
               "top_heads": result.top_heads[["layer", "head", "normalized"]].to_dict("records")}
    prompts = data.to_frame()
    _cli.write_outputs(args.out, "ioi_prompts", prompts, logit_diff_figure(result.logit_diff), summary)
    _cli.write_outputs(args.out, "ioi_logit_diff", result.logit_diff, logit_diff_figure(result.logit_diff), summary)
    _cli.write_outputs(args.out, "ioi_head_patching", result.head_patching,
                       patching_heatmap(result.head_patching, f"IOI head patching over {args.n} prompts (normalized)"),
                       {**summary, **result.head_patching.attrs})
    print(f"IOI logit difference over {args.n} prompts: clean {summary['mean_logit_diff_clean']:.3f}, "
          f"corrupted {summary['mean_logit_diff_corrupt']:.3f}")
    print("top heads by normalized patching effect:")
    print(result.top_heads.to_string(index=False))


if __name__ == "__main__":
    _cli.run_main(main)
