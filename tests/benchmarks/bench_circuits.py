"""Circuits: EAP over a dataset against TransformerLens's ``attribution_patch``, and batched exact edge
patching against one forward pass per edge.

1. EAP over 64 IOI-shaped pairs (16 tokens, two positions corrupted): ``edge_attribution_patching`` (padded batches
   of 16) against TransformerLens 4.3's ``attribution_patch(..., EdgeAttributionConfig(granularity="edge"))`` on a
   ``TransformerBridge`` of the same weights, which runs pair by pair. TransformerLens refuses grouped-query models
   at edge granularity (SmolLM2 has 3 key/value heads for 9 query heads), so both run a random GPT-2-shaped MHA model
   (4 layers, d_model 256, 8 heads) saved by `transformers`; the row also reports the largest score difference.
   Our EAP on SmolLM2 over the same number of IOI pairs is timed alone.
2. Exact patching of 64 edges of SmolLM2 (IOI, 8 pairs): ``edge_patching`` (variants stacked, each from its first
   edited layer, unembedding only the position the metric reads) against one plain forward pass per edge (full
   logits) through the same hooks.

    python tests/benchmarks/bench_circuits.py [--quick]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import workbench as wb
from experiments.circuits import circuit_graph, edge_attribution_patching, edge_patching
from experiments.circuits.exact import edge_masks
from experiments.circuits.runs import base_run, edge_switches, paired_prompts, patch_hooks, writer_values
from experiments.datasets import ioi_dataset
from experiments.metrics import LogitDiff
from experiments.patching.pairs import PairedPrompts
from tests.benchmarks.common import interleaved_timings, script_main, timing_rows

REPORT_NOTES = ("TransformerLens scores pair by pair (two forwards and a backward each); ours runs padded batches. "
                "The exact-patching baseline runs every edge as its own full forward pass with the same hooks.")


def _gpt2(directory: Path):
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    from transformer_lens.model_bridge import TransformerBridge

    from tests.integration.hf_tiny import randomize, word_tokenizer

    torch.manual_seed(0)
    hf = randomize(GPT2LMHeadModel(GPT2Config(vocab_size=101, n_embd=256, n_head=8, n_layer=4, n_positions=64,
                                              bos_token_id=1, eos_token_id=2)), std=0.05).eval()
    hf.set_attn_implementation("eager")
    hf.save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    bridge = TransformerBridge.boot_transformers(str(directory), hf_model=hf, tokenizer=tokenizer, device="cpu")
    return wb.load_model(str(directory)).eval(), bridge


def eap_rows(pairs: int, repeats: int) -> list[dict]:
    from transformer_lens.tools.analysis.attribution_patching import EdgeAttributionConfig, attribution_patch

    with tempfile.TemporaryDirectory() as directory:
        ours, bridge = _gpt2(Path(directory))
        generator = torch.Generator().manual_seed(0)
        clean = torch.randint(3, 101, (pairs, 16), generator=generator)
        corrupt = clean.clone()
        corrupt[:, [3, 7]] = torch.randint(3, 101, (pairs, 2), generator=generator)
        answer, wrong = torch.randint(3, 101, (2, pairs), generator=generator)
        metric = LogitDiff(answer, wrong)

        def theirs():
            return [attribution_patch(bridge, clean[b:b + 1], corrupt[b:b + 1],
                                      lambda logits, b=b: logits[0, -1, answer[b]] - logits[0, -1, wrong[b]],
                                      EdgeAttributionConfig(granularity="edge")) for b in range(pairs)]

        def mine():
            return edge_attribution_patching(ours, clean, corrupt, metric, batch_size=16)

        with torch.enable_grad():
            times = {"edge_attribution_patching (ours, batches of 16)": [], "attribution_patch (TL 4.3, edge)": []}
            for _ in range(repeats):
                for name, fn in zip(times, (mine, theirs)):
                    start = time.perf_counter()
                    result = fn()
                    times[name].append(time.perf_counter() - start)
                    if fn is mine:
                        ours_scores = result
                    else:
                        reference = result
        graph = ours_scores.graph
        names = {"embed": lambda n: "input", "attn_head_out": lambda n: f"a{n.layer}.h{n.head}",
                 "mlp_out": lambda n: f"m{n.layer}"}
        reader = lambda n: "logits" if n.kind == "logits" else (f"m{n.layer}" if n.kind == "mlp_in"  # noqa: E731
                                                               else f"a{n.layer}.h{n.head}<{n.kind[0]}>")
        worst = max(abs(sum(r.edge_scores[e] for r in reference) / pairs
                        - float(ours_scores.scores[e[0].position, graph.writer_index(names[e[0].kind](e[0])),
                                                   graph.reader_index(reader(e[1]))]))
                    for e in list(reference[0].edge_scores)[::97])
    extra = {"pairs": pairs, "max_abs_score_difference": worst, "model": "random GPT-2 shape (4 layers, 256, 8 heads)"}
    return timing_rows("EAP over IOI-shaped pairs", times, "attribution_patch (TL 4.3, edge)",
                       extra={name: extra for name in times})


def smollm2_eap_row(model, pairs: int) -> list[dict]:
    data = ioi_dataset(model, pairs, seed=0)
    start = time.perf_counter()
    edge_attribution_patching(model, data, batch_size=16)
    seconds = time.perf_counter() - start
    return [{"comparison": "EAP over IOI pairs, SmolLM2 (TL refuses GQA)", "contender": "edge_attribution_patching",
             "median_s": seconds, "repeats": 1, "pairs": pairs}]


def exact_rows(model, n_edges: int, repeats: int, timed: Callable[[Callable], Callable] = lambda fn: fn,
               data: Optional[PairedPrompts] = None, label: str = "exact edge patching, SmolLM2 IOI") -> list[dict]:
    """Stacked edge patching against one forward per edge, on the model's device, over ``data`` (8 IOI pairs by
    default); ``timed`` wraps each contender (the GPU bench's ``synchronized``, so a call is timed to the end of its
    GPU work)."""
    data = data if data is not None else paired_prompts(model, ioi_dataset(model, 8, seed=0))
    graph = circuit_graph(model)
    generator = torch.Generator().manual_seed(0)
    candidates = graph.edge_mask.flatten().nonzero().flatten()
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:n_edges]].tolist()
    R = len(graph.readers)
    edges = [graph.edge_name(i // R, i % R) for i in chosen]
    masks, _, _ = edge_masks(graph, edges, data.clean.tokens.shape[1])
    with edge_switches(model):
        sources = writer_values(model, graph, data.clean)
        start = base_run(model, graph, data.corrupt)

    def one_per_edge():  # a plain forward (full logits) with the edge's hooks, as a TransformerLens user runs it
        batch = data.corrupt
        with edge_switches(model), torch.no_grad():
            values = []
            for i in range(len(edges)):
                with model.hooks(fwd_hooks=patch_hooks(graph, batch, masks[i:i + 1], sources, start)):
                    logits = model(batch.tokens, attention_mask=batch.mask)
                values.append(data.metric.values(logits, batch)[None])
            return values

    times = interleaved_timings({"edge_patching (stacked)": timed(lambda: edge_patching(model, data, edges)),
                                 "one forward per edge": timed(one_per_edge)}, repeats=repeats, warmup=0)
    batched = edge_patching(model, data, edges).set_index("edge")["metric"]
    looped = torch.cat(one_per_edge()).mean(1)
    worst = max(abs(float(batched[e]) - float(v)) for e, v in zip(edges, looped))
    extra = {"edges": n_edges, "pairs": data.size, "max_abs_difference": worst}
    return timing_rows(label, times, "one forward per edge",
                       extra={name: extra for name in times})


def run(quick: bool = False) -> list[dict]:
    """Rows for BENCHMARKS.md."""
    rows = eap_rows(16 if quick else 64, 1 if quick else 2)
    model = wb.load_model("smollm2-135m", progress=False).eval()
    rows += smollm2_eap_row(model, 16 if quick else 64)
    rows += exact_rows(model, 16 if quick else 64, 1 if quick else 2)
    return rows


if __name__ == "__main__":
    script_main(__name__, "Circuits: EAP and exact edge patching", "16 pairs / 16 edges, one repeat")
