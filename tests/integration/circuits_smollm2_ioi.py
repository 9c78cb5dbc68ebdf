"""SmolLM2-135M's IOI circuit: too slow for the suite on a CPU (minutes), so a script whose printed
output the README reports.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m tests.integration.circuits_smollm2_ioi [--n 16] [--sample 60]

1. Head patching over the IOI pairs (``experiments.ioi.ioi_patching``): the top heads by normalized effect, the
   name-mover candidates.
2. EAP and EAP-IG (5 steps) edge scores over the same pairs, summed over positions.
3. Exact edge patching of a sample of edges (the strongest by EAP-IG and as many drawn at random): Pearson r of
   each method's scores with the exact effects.
4. The faithfulness curve of EAP-IG's strongest edges (corrupt ablation) and the smallest circuit on it that
   recovers 80% of the logit difference: its size, share of the edges, faithfulness and heads, and whether the
   top head-patching heads are among them.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import workbench as wb
from experiments.circuits import circuit_from_scores, edge_attribution_patching, edge_patching, faithfulness_curve
from experiments.datasets import ioi_dataset
from experiments.ioi import ioi_patching


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--sample", type=int, default=60, help="edges patched exactly (half strongest, half random)")
    parser.add_argument("--top-heads", type=int, default=3)
    args = parser.parse_args()
    start = time.time()
    model = wb.load_model("smollm2-135m", progress=False).eval()
    data = ioi_dataset(model, args.n, seed=0)
    heads = ioi_patching(model, data, top_k=args.top_heads, progress=False).top_heads
    top = [(int(l), int(h)) for l, h in heads[["layer", "head"]].values]
    print(f"head patching top {args.top_heads} (layer, head, normalized):",
          [(l, h, round(float(v), 3)) for (l, h), v in zip(top, heads["normalized"])], f"[{time.time() - start:.0f} s]")
    scores = {}
    for method in ("eap", "eap-ig"):
        t = time.time()
        scores[method] = edge_attribution_patching(model, data, method=method, ig_steps=5, batch_size=16)
        print(f"{method}: {time.time() - t:.0f} s, clean {scores[method].attrs['clean_metric']:.3f}, "
              f"corrupt {scores[method].attrs['corrupt_metric']:.3f}")
    graph = scores["eap-ig"].graph
    summed = scores["eap-ig"].summed()
    flat = summed.abs().masked_fill(~graph.edge_mask, -1).flatten()
    strongest = flat.topk(args.sample // 2).indices
    generator = torch.Generator().manual_seed(0)
    candidates = graph.edge_mask.flatten().nonzero().flatten()
    drawn = candidates[torch.randperm(len(candidates), generator=generator)[:args.sample]]
    drawn = [i for i in drawn.tolist() if i not in set(strongest.tolist())][:args.sample - len(strongest)]
    chosen = strongest.tolist() + drawn
    R = len(graph.readers)
    edges = [graph.edge_name(i // R, i % R) for i in chosen]
    t = time.time()
    exact = edge_patching(model, data, None, None, edges, batch_size=16).set_index("edge")["delta"]
    print(f"exact patching of {len(edges)} edges: {time.time() - t:.0f} s")
    truth = np.array([exact[e] for e in edges])
    for method, result in scores.items():
        estimate = np.array([float(result.summed()[graph.edge_index(e)]) for e in edges])
        r = np.corrcoef(estimate, truth)[0, 1]
        r_random = np.corrcoef(estimate[len(strongest):], truth[len(strongest):])[0, 1]
        print(f"{method}: Pearson r with exact patching {r:.3f} (all sampled edges), {r_random:.3f} (random half)")
    t = time.time()
    curve = faithfulness_curve(model, data, None, scores["eap-ig"], batch_size=16)
    print(f"faithfulness curve ({time.time() - t:.0f} s):")
    print(curve.round(4).to_string(index=False))
    reaching = curve[curve["recovered"] >= 0.8]
    if len(reaching):
        n = int(reaching["n_edges"].iloc[0])
        circuit = circuit_from_scores(scores["eap-ig"], top_n=n)
        print(f"circuit: {n} edges of {graph.n_edges} ({100 * n / graph.n_edges:.2f}%), recovers "
              f"{float(reaching['recovered'].iloc[0]):.3f} of the logit difference")
        print("heads:", " ".join(f"L{l}H{h}" for l, h in circuit.heads))
        print("top head-patching heads in the circuit:", {f"L{l}H{h}": (l, h) in circuit.heads for l, h in top})
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
