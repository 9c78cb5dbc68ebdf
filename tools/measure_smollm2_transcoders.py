"""Measures the shipped SmolLM2-135M transcoders for their card (every figure of ``CARD.md`` comes from here).

    nice -n 19 python tools/measure_smollm2_transcoders.py --out metrics.json

On held-out English (``experiments.cli.sae.data_windows(model, "english-held-out")``, never trained on):

- each layer's explained variance of the MLP output (SAELens's ``1 - sum ||y - y_hat||^2 / sum ||y - mean y||^2``,
  ``y`` = ``blocks.L.hook_mlp_out``, ``y_hat`` = ``TranscoderSet.reconstruct`` from the layer's own input) and L0,
  over every token but the first of each window (BOS);
- the spliced model's next-token loss (every MLP replaced by its transcoder, no error terms:
  ``experiments.attribution.ReplacementModel.forward``) against the clean model and the model with every MLP's
  output zeroed; loss recovered = (ablated - spliced) / (ablated - clean);
- ``experiments.attribution.compute_graph_scores`` (replacement, completeness) of the attribution graph
  (``attribute`` with the Attribution page's default settings) of five held-out prompts: the first ``--prompt-tokens``
  tokens of five further held-out windows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

NAME = "smollm2-135m-skip-transcoders"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy


def layer_quality(model, tc, windows) -> list[dict]:
    """Per layer: explained variance of the MLP output and mean L0, over every position but the first."""
    hooks = [tc.input_hook(l) for l in range(tc.n_layers)] + [tc.output_hook(l) for l in range(tc.n_layers)]
    sq_err = torch.zeros(tc.n_layers, dtype=torch.float64)
    total = torch.zeros(tc.n_layers, tc.d_model, dtype=torch.float64)
    total_sq = torch.zeros(tc.n_layers, dtype=torch.float64)
    active = torch.zeros(tc.n_layers, dtype=torch.float64)
    n = 0
    with torch.no_grad():
        for row in windows:
            _, cache = model.run_with_cache(row[None], names_filter=hooks, return_type=None)
            inputs_LPD = torch.stack([cache[tc.input_hook(l)][0, 1:] for l in range(tc.n_layers)]).float()
            y_LPD = torch.stack([cache[tc.output_hook(l)][0, 1:] for l in range(tc.n_layers)]).double()
            acts = [tc.encode(l, inputs_LPD[l]) for l in range(tc.n_layers)]
            y_hat = tc.reconstruct(acts, inputs_LPD).double()
            sq_err += ((y_LPD - y_hat) ** 2).sum(dim=(1, 2))
            total += y_LPD.sum(dim=1)
            total_sq += (y_LPD ** 2).sum(dim=(1, 2))
            active += torch.tensor([float((a > 0).sum()) for a in acts], dtype=torch.float64)
            n += inputs_LPD.shape[1]
    variance = total_sq - (total ** 2).sum(dim=1) / n  # sum ||y - mean y||^2
    return [{"layer": l, "explained_variance": round(float(1 - sq_err[l] / variance[l]), 4),
             "l0": round(float(active[l] / n), 1)} for l in range(tc.n_layers)]


def spliced_loss(model, tc, windows) -> dict:
    """Mean next-token loss of the clean, spliced (all MLPs -> transcoders) and MLP-ablated model."""
    from experiments.attribution import ReplacementModel

    replacement = ReplacementModel(model, tc)
    zero = [(f"blocks.{l}.hook_mlp_out", lambda out, hook: torch.zeros_like(out)) for l in range(tc.n_layers)]
    losses = {"clean": [], "spliced": [], "ablated": []}
    with torch.no_grad():
        for row in windows:
            targets = row[1:]
            for kind, logits in (("clean", model(row[None])[0]), ("spliced", replacement.forward(row)),
                                 ("ablated", model.run_with_hooks(row[None], fwd_hooks=zero)[0])):
                losses[kind].append(torch.nn.functional.cross_entropy(logits[:-1].float(), targets))
    out = {f"ce_loss_{kind}": round(float(torch.stack(values).mean()), 4) for kind, values in losses.items()}
    gap = out["ce_loss_ablated"] - out["ce_loss_clean"]
    out["loss_recovered"] = round((out["ce_loss_ablated"] - out["ce_loss_spliced"]) / gap, 4)
    return out


def graph_scores(model, tc, prompts, max_feature_nodes=None) -> list[dict]:
    """``compute_graph_scores`` of each prompt's graph (the page's settings: 10 logits, 0.95, batch 256)."""
    from experiments.attribution import attribute, compute_graph_scores

    rows = []
    for prompt in prompts:
        start = time.time()
        graph = attribute(model, tc, prompt.tolist(), max_n_logits=10, desired_logit_prob=0.95,
                          max_feature_nodes=max_feature_nodes, batch_size=256, progress=False)
        replacement, completeness = compute_graph_scores(graph)
        rows.append({"prompt": model.to_string(prompt), "n_tokens": len(prompt),
                     "active_features": len(graph.active_features), "replacement": round(float(replacement), 4),
                     "completeness": round(float(completeness), 4), "seconds": round(time.time() - start, 1)})
        print(rows[-1], flush=True)
    return rows


def card_tables(figures: dict) -> str:
    """The card's tables (markdown) from the figures ``main`` writes: per-layer quality, the spliced loss, the graphs."""
    lines = ["| layer | explained variance | L0 |", "|---|---|---|"]
    lines += [f"| {row['layer']} | {row['explained_variance']:.4f} | {row['l0']:.1f} |" for row in figures["layers"]]
    spliced = figures.get("spliced")
    if spliced:
        lines += ["", "| clean loss | spliced loss (all 30 MLPs replaced) | MLPs zeroed | loss recovered |",
                  "|---|---|---|---|",
                  f"| {spliced['ce_loss_clean']:.4f} | {spliced['ce_loss_spliced']:.4f} "
                  f"| {spliced['ce_loss_ablated']:.4f} | {spliced['loss_recovered']:.4f} |"]
    if figures.get("graphs"):
        lines += ["", "| held-out prompt | tokens | active features | replacement | completeness |", "|---|---|---|---|---|"]
        lines += [f"| {json.dumps(row['prompt'])[1:-1].replace('|', '/')} | {row['n_tokens']} | {row['active_features']} "
                  f"| {row['replacement']:.4f} | {row['completeness']:.4f} |" for row in figures["graphs"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transcoders", default=NAME, help="a shipped name or a path (wb.load_transcoders)")
    parser.add_argument("--windows", type=int, default=8, help="held-out 128-token windows for the layer figures")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--layers-only", action="store_true", help="skip the attribution graphs")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    parser.add_argument("--max-feature-nodes", type=int, default=None, help="attribute's (None: every feature)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import workbench as wb
    from experiments.cli.sae import data_windows

    model = wb.load_model("smollm2-135m")
    tc = wb.load_transcoders(args.transcoders, dtype=torch.float32)
    held_out = data_windows(model, "english-held-out", n_windows=args.windows + 5)
    figures = {"transcoders": args.transcoders, "windows": args.windows, "tokens_per_window": held_out.shape[1]}
    figures["layers"] = layer_quality(model, tc, held_out[:args.windows])
    print(figures["layers"], flush=True)
    figures["spliced"] = spliced_loss(model, tc, held_out[:args.windows])
    print(figures["spliced"], flush=True)
    if not args.layers_only:
        figures["graphs"] = graph_scores(model, tc, held_out[args.windows:, :args.prompt_tokens],
                                         args.max_feature_nodes)
    text = json.dumps(figures, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    print(card_tables(figures))


if __name__ == "__main__":
    main()
