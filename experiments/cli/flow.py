"""``python -m experiments.flow --model NAME --out DIR [--prompt TEXT --position P --threshold T]``: the graph of
edges that carry one token's prediction, written as CSV, JSON and HTML.
"""

from __future__ import annotations

from typing import Optional, Sequence

from experiments import _cli
from experiments.flow import DEFAULT_THRESHOLD, flow_contributions, flow_graph
from experiments.plots.flow import flow_figure


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The information-flow graph of a prompt's last token, written as CSV, JSON and HTML under ``--out``; ``argv``: the arguments (default: ``sys.argv``).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as out:
        ...     main(["--model", "toy-attn-2l", "--out", out, "--no-progress"])
        wrote ...information_flow.csv
        ...
        wrote ...information_flow.html
    """
    parser = _cli.make_parser("Information flow routes: the graph of edges that carry one token's prediction.", "flow")
    parser.add_argument("--prompt", default=None)
    parser.add_argument("--position", type=int, default=-1, help="the token whose prediction is traced (default: last)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    args = parser.parse_args(argv)
    model = _cli.load(args)
    tokens = _cli.prompt_tokens(model, args.prompt)
    contributions = flow_contributions(model, tokens, progress=not args.no_progress)
    nodes, edges = flow_graph(contributions, args.position, args.threshold)
    fig = flow_figure(nodes, edges, contributions.str_tokens, contributions.n_layers)
    _cli.write_outputs(args.out, "information_flow", edges, fig,
                       {"experiment": "information_flow", "model": args.model, "position": args.position,
                        "threshold": args.threshold, "str_tokens": contributions.str_tokens,
                        "nodes": nodes.to_dict(orient="records")})


if __name__ == "__main__":
    _cli.run_main(main)
