"""The README's figures of shipped toy models, drawn by the library's own plotting functions and saved as PNGs
through Chromium (plotly's static export needs kaleido, which we do not ship).

- ``attribution_toy_moe.png``: the pruned attribution graph of a prompt on ``toy-moe-2l`` through its shipped
  per-layer skip transcoders (``experiments.plots.attribution.graph_figure``, the Attribution page's drawing);
- ``circuit_toy_attn.png``: the induction circuit of ``toy-attn-2l`` found by EAP-IG over repeated random tokens
  (``experiments.plots.circuits.circuit_figure``, what ``python -m experiments.circuits`` writes).

    python docs/make_figures.py          # writes docs/screenshots/*.png; prints each figure's numbers
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import workbench as wb  # noqa: E402
from experiments.attribution import attribute, compute_graph_scores, prune_graph  # noqa: E402
from experiments.circuits import discover_circuit, faithfulness  # noqa: E402
from experiments.circuits.tasks import induction_pairs  # noqa: E402
from experiments.plots.attribution import graph_figure  # noqa: E402
from experiments.plots.circuits import circuit_figure  # noqa: E402

OUT = ROOT / "docs" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
PROMPT = "    def __init__(self, name):\n        self.name = name\n        self."


def save_png(figure, path: Path, width: int = 1000, height: int = 600) -> None:
    """``figure`` rendered by Chromium at ``width`` x ``height`` and saved as a PNG."""
    from playwright.sync_api import sync_playwright

    figure.update_layout(width=width, height=height)
    with tempfile.TemporaryDirectory() as directory:
        html = Path(directory) / "figure.html"
        figure.write_html(html, include_plotlyjs=True, full_html=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM if Path(CHROMIUM).exists() else None)
            page = browser.new_page(viewport={"width": width + 40, "height": height + 40})
            page.goto(html.as_uri())
            page.wait_for_selector(".main-svg")
            page.locator(".js-plotly-plot").first.screenshot(path=str(path))
            browser.close()
    print("wrote", path.relative_to(ROOT))


def attribution_figure() -> None:
    model = wb.load_model("toy-moe-2l", progress=False).eval()
    transcoders = wb.load_transcoders(ROOT / "workbench/zoo/toy-moe-2l/transcoders/toy-moe-2l-skip-transcoders")
    graph = attribute(model, transcoders, PROMPT, max_n_logits=5, desired_logit_prob=0.8, progress=False)
    pruned = prune_graph(graph, node_threshold=0.7, edge_threshold=0.95)
    replacement, completeness = compute_graph_scores(graph)
    drawing = graph_figure(graph, pruned, max_nodes=60, max_edges=200, title=f"toy-moe-2l, skip transcoders: {len(graph.active_features)} active "
                                                f"features, replacement {replacement:.2f}, completeness "
                                                f"{completeness:.2f}")
    print(f"attribution: {drawing.n_kept_nodes} nodes and {drawing.n_kept_edges} edges kept ({len(drawing.nodes)} and "
          f"{drawing.n_edges} drawn), replacement score "
          f"{replacement:.3f}, completeness {completeness:.3f}")
    save_png(drawing.figure, OUT / "attribution_toy_moe.png")


def circuit_figure_png() -> None:
    model = wb.load_model("toy-attn-2l", progress=False).eval()
    pairs = induction_pairs(model, seq_len=10, n=16, seed=0)
    circuit = discover_circuit(model, pairs, method="eap-ig", top_n=20)
    share = faithfulness(model, pairs, None, circuit).recovered
    print(f"circuit: {len(circuit.edges)} edges recover {share:.3f} of the clean - corrupt gap (corrupt ablation)")
    save_png(circuit_figure(circuit, title=f"toy-attn-2l induction: the 20 strongest EAP-IG edges recover "
                                           f"{share:.2f} of the gap"), OUT / "circuit_toy_attn.png")


if __name__ == "__main__":
    torch.manual_seed(0)
    attribution_figure()
    circuit_figure_png()
