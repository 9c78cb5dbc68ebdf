"""experiments.attribution against circuit-tracer 0.5 itself: the graphs, pruning masks and scores in
tests/fixtures/attribution/expected_*.safetensors were written by make_attribution_fixtures.py (circuit-tracer's
nnsight backend on the same tiny Llama and transcoder files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from experiments.attribution import (AttributionGraph, attribute, compute_graph_scores, intervene, prune_graph,
                                     write_graph_files)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "attribution"
CASES = {"plt": "plt", "plt_skip": "plt_skip", "clt": "clt", "plt_limited": "plt"}


@pytest.fixture(scope="module")
def tiny_llama():
    return wb.load_model(FIXTURES / "tiny_llama")


def _run(model, case: str, forward_memory: int | None = None) -> tuple[AttributionGraph, dict, dict]:
    expected = load_file(str(FIXTURES / f"expected_{case}.safetensors"))
    meta = json.loads((FIXTURES / f"expected_{case}.json").read_text())
    options = {} if forward_memory is None else {"forward_memory": forward_memory}
    graph = attribute(model, wb.load_transcoders(FIXTURES / CASES[case]), meta["prompt_ids"],
                      max_n_logits=meta["max_n_logits"], desired_logit_prob=meta["desired_logit_prob"],
                      batch_size=meta["batch_size"], max_feature_nodes=meta["max_feature_nodes"], progress=False,
                      **options)
    return graph, expected, meta


# A forward_memory of one byte leaves one copy of the prompt in the frozen forward pass (each batch of targets
# then takes batch_size backward passes): the graph, and which features a limited graph visits, are circuit-tracer's.
@pytest.mark.parametrize("case, forward_memory", [(case, None) for case in CASES] +
                         [("plt_limited", 1), ("clt", 1)])
def test_graph_matches_circuit_tracer(tiny_llama, case, forward_memory):
    graph, expected, meta = _run(tiny_llama, case, forward_memory)
    assert torch.equal(graph.input_tokens, expected["input_tokens"])
    assert torch.equal(graph.active_features, expected["active_features"])
    torch.testing.assert_close(graph.activation_values, expected["activation_values"], rtol=1e-4, atol=1e-5)
    assert torch.equal(graph.selected_features, expected["selected_features"])   # influence order when limited
    assert torch.equal(graph.logit_token_ids, expected["logit_token_ids"])
    torch.testing.assert_close(graph.logit_probabilities, expected["logit_probabilities"], rtol=1e-5, atol=1e-7)
    reference = expected["adjacency_matrix"]
    assert graph.adjacency_matrix.shape == reference.shape
    relative = (graph.adjacency_matrix - reference).abs().max() / reference.abs().max()
    assert relative < 1e-4, f"adjacency differs by {relative:.2e} of its largest entry"
    pruned = prune_graph(graph, node_threshold=0.8, edge_threshold=0.98)
    assert torch.equal(pruned.node_mask, expected["node_mask"])
    assert torch.equal(pruned.edge_mask, expected["edge_mask"])
    torch.testing.assert_close(pruned.cumulative_scores, expected["cumulative_scores"], rtol=1e-4, atol=1e-5)
    replacement, completeness = compute_graph_scores(graph)
    assert replacement == pytest.approx(meta["replacement_score"], rel=1e-4)
    assert completeness == pytest.approx(meta["completeness_score"], rel=1e-4)


def test_text_prompt_gets_the_bos_first_and_the_graph_round_trips(tiny_llama, tmp_path):
    graph = attribute(tiny_llama, wb.load_transcoders(FIXTURES / "plt"), "the cat sat on the mat and",
                      max_n_logits=5, desired_logit_prob=0.8, batch_size=64, progress=False)
    expected = load_file(str(FIXTURES / "expected_plt.safetensors"))
    assert graph.input_tokens.tolist() == expected["input_tokens"].tolist()   # <bos> prepended, as circuit-tracer
    assert torch.equal(graph.active_features, expected["active_features"])
    back = AttributionGraph.load(graph.save(tmp_path / "graph"))
    assert torch.equal(back.adjacency_matrix, graph.adjacency_matrix) and back.input_string == graph.input_string
    assert back.logit_token_strings == graph.logit_token_strings and torch.equal(back.logit_tokens, graph.logit_token_ids)


def test_viewer_json_matches_circuit_tracers_create_graph_files(tiny_llama, tmp_path):
    graph, _, _ = _run(tiny_llama, "plt")
    path = write_graph_files(graph, "plt", tmp_path, node_threshold=0.8, edge_threshold=0.98)
    ours, theirs = (json.loads(p.read_text()) for p in (path, FIXTURES / "graph_files" / "plt.json"))
    assert ours["metadata"] == theirs["metadata"] and ours["qParams"] == theirs["qParams"]
    assert [n["node_id"] for n in ours["nodes"]] == [n["node_id"] for n in theirs["nodes"]]
    for mine, ref in zip(ours["nodes"], theirs["nodes"]):
        assert mine.keys() == ref.keys()
        for key, value in ref.items():
            if isinstance(value, float):
                assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (ref["node_id"], key)
            else:
                assert mine[key] == value, (ref["node_id"], key)
    assert [(l["source"], l["target"]) for l in ours["links"]] == [(l["source"], l["target"]) for l in theirs["links"]]
    scale = max(abs(l["weight"]) for l in theirs["links"])
    assert all(abs(a["weight"] - b["weight"]) < 1e-4 * scale for a, b in zip(ours["links"], theirs["links"]))
    index = json.loads((tmp_path / "graph-metadata.json").read_text())
    assert index == json.loads((FIXTURES / "graph_files" / "graph-metadata.json").read_text())


@pytest.mark.parametrize("case", ["plt", "plt_skip", "clt"])
def test_interventions_match_circuit_tracers_feature_intervention(tiny_llama, case):
    expected = load_file(str(FIXTURES / f"expected_{case}_interventions.safetensors"))
    meta = json.loads((FIXTURES / f"expected_{case}_interventions.json").read_text())
    tc = wb.load_transcoders(FIXTURES / case)
    prompt = json.loads((FIXTURES / f"expected_{case}.json").read_text())["prompt_ids"]
    clean = tiny_llama(torch.tensor([prompt]))[0]
    for mode, options in meta["modes"].items():
        result = intervene(tiny_llama, tc, prompt, [tuple(i) for i in meta["interventions"]], **options)
        logits, acts = expected[f"{mode}.logits"], expected[f"{mode}.activations"]
        assert (logits - clean).abs().max() > 0.1   # the intervention matters
        torch.testing.assert_close(result.logits, logits, rtol=1e-4, atol=1e-4 * logits.abs().max().item())
        torch.testing.assert_close(result.activations, acts, rtol=1e-4, atol=1e-4 * acts.abs().max().item())


def test_saelens_copies_of_the_transcoders_give_circuit_tracers_graph(tiny_llama, tmp_path):
    """The plt fixture rewritten as SAELens transcoders (W_enc transposed, threshold renamed) loads through
    wb.load_sae and gives the same graph."""
    expected = load_file(str(FIXTURES / "expected_plt.safetensors"))
    for layer in range(3):
        file = load_file(str(FIXTURES / "plt" / f"layer_{layer}.safetensors"))
        threshold = file.get("activation_function.threshold")
        tensors = {"W_enc": file["W_enc"].T.contiguous(), "W_dec": file["W_dec"], "b_enc": file["b_enc"],
                   "b_dec": file["b_dec"], **({} if threshold is None else {"threshold": threshold})}
        cfg = wb.SAEConfig("transcoder" if threshold is None else "jumprelu_transcoder", d_in=16, d_sae=12, d_out=16,
                           apply_b_dec_to_input=False, metadata=wb.SAEMetadata(
                               hook_name=f"blocks.{layer}.ln2.hook_normalized", hook_name_out=f"blocks.{layer}.hook_mlp_out"))
        wb.SAE.from_tensors(cfg, tensors).save(tmp_path / f"layer_{layer}")
    graph = attribute(tiny_llama, wb.load_transcoders(tmp_path), expected["input_tokens"], max_n_logits=5,
                      desired_logit_prob=0.8, batch_size=16, progress=False)
    assert torch.equal(graph.active_features, expected["active_features"])
    reference = expected["adjacency_matrix"]
    assert (graph.adjacency_matrix - reference).abs().max() < 1e-4 * reference.abs().max()
