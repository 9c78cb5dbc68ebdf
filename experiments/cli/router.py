"""``python -m experiments.router --model NAME --out DIR [--prompt TEXT]``: expert load, router entropy and, with
shared experts, the shared vs routed experts' output, written as CSV, JSON and HTML.
"""

from __future__ import annotations

from typing import Optional, Sequence

from experiments import _cli
from experiments._tokens import str_tokens
from experiments.plots.router import expert_load_figure, shared_vs_routed_figure
from experiments.router import expert_load, router_entropy, shared_expert_layers, shared_vs_routed


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Expert load and router entropy (and the shared experts' share, where there are some), written as CSV, JSON and HTML under ``--out``; ``argv``: the arguments (default: ``sys.argv``).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as out:
        ...     main(["--model", "toy-moe-2l", "--out", out, "--no-progress"])
        wrote ...router.csv
        ...
        wrote ...router.html
    """
    parser = _cli.make_parser("Mixture-of-experts routing: expert load, router entropy and, with shared experts, "
                              "the shared vs routed experts' output.", "router")
    parser.add_argument("--prompt", default=None)
    args = parser.parse_args(argv)
    model = _cli.load(args)
    if not model.cfg.is_moe:
        raise SystemExit(f"{args.model or 'the default model'} has no mixture of experts; the router experiment needs one")
    tokens = _cli.prompt_tokens(model, args.prompt)
    load = expert_load(model, tokens)
    entropy = router_entropy(model, tokens)
    _cli.write_outputs(args.out, "router", load, expert_load_figure(load),
                       {"experiment": "router", "model": args.model, "moe_layers": model.cfg.moe_layers,
                        "mean_router_entropy_by_layer": entropy.groupby("layer").entropy.mean().to_dict()})
    if shared_expert_layers(model):
        shared = shared_vs_routed(model, tokens)
        labels = str_tokens(model, model.as_tokens(tokens)[0])
        _cli.write_outputs(args.out, "router_shared", shared, shared_vs_routed_figure(shared, labels),
                           {"experiment": "router_shared", "model": args.model,
                            "mean_shared_fraction_by_layer": shared.groupby("layer").shared_fraction.mean().to_dict()})


if __name__ == "__main__":
    _cli.run_main(main)
