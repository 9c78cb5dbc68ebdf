"""Our circuits against TransformerLens 4.3's own ``tools.analysis.attribution_patching`` on the same weights.

A tiny random GPT-2 (``hf_tiny.build_and_save("gpt2")``: 2 layers, 6 heads, MHA) is saved once and loaded by
``wb.load_model`` and, as the reference, by ``TransformerBridge.boot_transformers`` around the very
`transformers` model. TransformerLens scores pair by pair (``attribution_patch`` with
``EdgeAttributionConfig(granularity="edge")`` over a batch averages its pairs); its nodes map onto ours as
embed -> ``input``, attn_head_out L.H -> ``aL.hH``, mlp_out L -> ``mL``, q/k/v_input -> ``aL.hH<q>`` ...,
mlp_in -> ``mL``, logits -> ``logits``, its position -> our position axis. Its embed writer is ``hook_embed``,
ours the residual stream entering block 0; the position embeddings are the same in both runs of a pair, so the
differences agree. Tolerance: 1e-4 of each score, with a floor of 1e-6 for near-zero edges (float32 rounding;
the largest scores are ~0.2).
"""

from __future__ import annotations

import pytest
import torch
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.tools.analysis.attribution_patching import EdgeAttributionConfig, attribution_patch
from transformers import PreTrainedTokenizerFast

import workbench as wb
from experiments.circuits import edge_attribution_patching
from experiments.metrics import LogitDiff
from tests.integration.hf_tiny import VOCAB, build_and_save

BATCH, P = 3, 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_gpt2_circuits")
    hf_model = build_and_save("gpt2", directory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    bridge = TransformerBridge.boot_transformers(str(directory), hf_model=hf_model, tokenizer=tokenizer, device="cpu")
    return wb.load_model(str(directory)).eval(), bridge


@pytest.fixture(scope="module")
def pairs():
    generator = torch.Generator().manual_seed(7)
    clean = torch.randint(3, VOCAB, (BATCH, P), generator=generator)
    clean[:, 0] = 1
    corrupt = clean.clone()
    corrupt[:, [2, 5]] = torch.randint(3, VOCAB, (BATCH, 2), generator=generator)
    return clean, corrupt, torch.tensor([5, 9, 11]), torch.tensor([7, 3, 20])


def tl_metric(answer, wrong, b):
    return lambda logits: logits[0, -1, answer[b]] - logits[0, -1, wrong[b]]


def writer_name(node) -> str:
    return {"embed": "input", "attn_head_out": f"a{node.layer}.h{node.head}", "mlp_out": f"m{node.layer}"}[node.kind]


def reader_name(node) -> str:
    if node.kind == "logits":
        return "logits"
    if node.kind == "mlp_in":
        return f"m{node.layer}"
    return f"a{node.layer}.h{node.head}<{node.kind[0]}>"


def test_eap_scores_equal_transformer_lens_attribution_patch_edge_by_edge(models, pairs):
    ours, bridge = models
    clean, corrupt, answer, wrong = pairs
    theirs = [attribution_patch(bridge, clean[b:b + 1], corrupt[b:b + 1], tl_metric(answer, wrong, b),
                                EdgeAttributionConfig(granularity="edge")) for b in range(BATCH)]
    scores = edge_attribution_patching(ours, clean, corrupt, LogitDiff(answer, wrong))
    graph = scores.graph
    expected, got = [], []
    for writer, reader in theirs[0].edge_scores:
        expected.append(sum(result.edge_scores[(writer, reader)] for result in theirs) / BATCH)
        got.append(float(scores.scores[writer.position, graph.writer_index(writer_name(writer)),
                                       graph.reader_index(reader_name(reader))]))
    # every edge TransformerLens defines is one of ours, at every position, and nothing more
    assert len(expected) == P * graph.n_edges
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-4, atol=1e-6)


def test_faithfulness_under_corrupt_ablation_equals_transformer_lens_on_one_pair(models, pairs):
    """The same per-position edges kept (TransformerLens's 60 strongest of the pair plus some of its weakest), every
    other edge ablated to the corrupted run: its ``faithfulness`` and ours recover the same share of the gap."""
    from transformer_lens.tools.analysis.attribution_patching import faithfulness as tl_faithfulness

    from experiments.circuits import Circuit, faithfulness

    ours, bridge = models
    clean, corrupt, answer, wrong = pairs
    fn = tl_metric(answer, wrong, 0)
    result = attribution_patch(bridge, clean[:1], corrupt[:1], fn, EdgeAttributionConfig(granularity="edge"))
    ranked = result.top_edges(k=len(result.edge_scores))
    kept = [(w, r) for w, r, _ in ranked[:60] + ranked[-20:]]
    theirs = tl_faithfulness(bridge, clean[:1], corrupt[:1], fn, kept)
    graph = edge_attribution_patching(ours, clean[:1], corrupt[:1], LogitDiff(answer[:1], wrong[:1])).graph
    mask = torch.zeros(P, *graph.edge_mask.shape, dtype=torch.bool)
    for writer, reader in kept:
        mask[writer.position, graph.writer_index(writer_name(writer)), graph.reader_index(reader_name(reader))] = True
    got = faithfulness(ours, (clean[:1], corrupt[:1]), LogitDiff(answer[:1], wrong[:1]), Circuit(graph, mask))
    assert got.n_edges == theirs.circuit_size and got.total_edges == theirs.total_edges
    assert abs(got.clean_metric - theirs.full_metric) < 1e-4 and abs(got.corrupt_metric - theirs.corrupt_metric) < 1e-4
    assert abs(got.recovered - theirs.recovered) < 1e-4
