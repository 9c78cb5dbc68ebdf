"""``python -m experiments.circuits --model NAME --task ioi|induction --method eap|eap-ig --out DIR [--n 32
--ig-steps 5 --top-n K | --target 0.8]``: edge attribution over the task's prompt pairs, the faithfulness curve of
the strongest edges, and the circuit (the smallest on the curve recovering ``--target`` of the gap, or the
``--top-n`` strongest edges); writes ``circuit_edges``, ``circuit_faithfulness`` and ``circuit`` as CSV/JSON/HTML."""

from __future__ import annotations

from typing import Optional, Sequence

from experiments import _cli
from experiments.circuits import (PairedPrompts, circuit_from_scores, edge_attribution_patching, faithfulness,
                                  faithfulness_curve)
from experiments.circuits.tasks import induction_pairs
from experiments.datasets import ioi_dataset
from experiments.plots.circuits import circuit_figure, edge_bars, faithfulness_curve_figure


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Runs the command on ``argv`` (default: the process's arguments).

    Example:
        >>> import tempfile
        >>> main(["--model", "toy-attn-2l", "--task", "induction", "--n", "2", "--seq-len", "6", "--ig-steps", "2",
        ...       "--out", tempfile.mkdtemp(), "--no-progress"])
        wrote .../circuit_edges.csv
        ...
        wrote .../circuit.html
        circuit: ... edges (...% of 81), recovers ... of the gap (corrupt ablation)
        heads: ...
    """
    parser = _cli.make_parser("Circuit discovery: edge attribution (EAP, EAP-IG), faithfulness curve, the circuit.",
                              "circuits")
    parser.add_argument("--task", default="ioi", choices=("ioi", "induction"))
    parser.add_argument("--method", default="eap-ig", choices=("eap", "eap-ig"))
    parser.add_argument("--ig-steps", type=int, default=5)
    parser.add_argument("--n", type=int, default=32, help="prompt pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=20, help="induction: length of the repeated sequence")
    parser.add_argument("--names", nargs="+", default=None, help="IOI: names to draw (default: single-token names)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--top-n", type=int, default=None, help="keep this many edges (default: by --target)")
    parser.add_argument("--target", type=float, default=0.8, help="the smallest circuit on the curve recovering this")
    parser.add_argument("--ablation", default="corrupt", choices=("corrupt", "mean", "zero"))
    args = parser.parse_args(argv)
    model = _cli.load(args)
    if args.task == "ioi":
        pairs = PairedPrompts.from_prompts(model, ioi_dataset(model, args.n, seed=args.seed, names=args.names))
    else:
        pairs = induction_pairs(model, args.seq_len, args.n, args.seed)
    progress = not args.no_progress
    scores = edge_attribution_patching(model, pairs, method=args.method, ig_steps=args.ig_steps,
                                       batch_size=args.batch_size, progress=progress)
    summary = {"model": args.model, "task": args.task, "method": args.method, "ig_steps": args.ig_steps, "n": args.n,
               "ablation": args.ablation, **scores.attrs}
    edges = scores.to_frame(positions="sum")
    _cli.write_outputs(args.out, "circuit_edges", edges, edge_bars(edges), summary)
    curve = faithfulness_curve(model, pairs, scores, ablation=args.ablation, batch_size=args.batch_size,
                               progress=progress)
    _cli.write_outputs(args.out, "circuit_faithfulness", curve, faithfulness_curve_figure(curve), summary)
    top_n = args.top_n
    if top_n is None:
        reaching = curve[curve["recovered"] >= args.target]
        top_n = int(reaching["n_edges"].iloc[0]) if len(reaching) else int(curve["n_edges"].iloc[-1])
    circuit = circuit_from_scores(scores, top_n=top_n)
    kept = faithfulness(model, pairs, circuit, args.ablation, batch_size=args.batch_size)
    circuit_summary = {**summary, "n_edges": circuit.n_edges, "share": circuit.share, "recovered": kept.recovered,
                       "circuit_metric": kept.circuit_metric, "nodes": circuit.nodes,
                       "heads": [list(h) for h in circuit.heads]}
    _cli.write_outputs(args.out, "circuit", circuit.to_frame(), circuit_figure(circuit), circuit_summary)
    print(f"circuit: {circuit.n_edges} edges ({100 * circuit.share:.1f}% of {circuit.graph.n_edges}), recovers "
          f"{kept.recovered:.3f} of the gap ({args.ablation} ablation)")
    print("heads:", " ".join(f"L{l}H{h}" for l, h in circuit.heads))


if __name__ == "__main__":
    _cli.run_main(main)
