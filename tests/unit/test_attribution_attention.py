"""Attention explained: an edge split per head (the parts, with the residual-only part, sum to the edge of
circuit-tracer's graph, itself checked against circuit-tracer by the parity tests) and a head's score split over
(query part, key part) pairs (summing to ``hook_attn_scores``); both by hand on a one-layer, one-head toy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from experiments.attribution import attribute
from experiments.attribution.attention import attention_qk, edge_heads
from workbench.errors import InputError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "attribution"
PROMPT = [1, 3, 4, 5, 6, 3, 7, 15]


@pytest.fixture(scope="module")
def tiny_llama():
    return wb.load_model(FIXTURES / "tiny_llama")


@pytest.fixture(scope="module", params=["plt_skip", "clt"])
def case(request, tiny_llama):
    tc = wb.load_transcoders(FIXTURES / request.param)
    return tc, attribute(tiny_llama, tc, PROMPT, progress=False)


def _edges(graph):
    """A feature-to-feature edge across positions, one within a position, and a token's edge to a logit."""
    A, n_features = graph.adjacency_matrix, len(graph.selected_features)
    where = graph.active_features[graph.selected_features]
    across = [(t, s) for t in range(n_features) for s in range(n_features)
              if where[s, 1] < where[t, 1] and where[s, 0] < where[t, 0] and A[t, s] != 0]
    within = [(t, s) for t in range(n_features) for s in range(n_features)
              if where[s, 1] == where[t, 1] and where[s, 0] < where[t, 0] and A[t, s] != 0]
    logit = graph.n_nodes - 1
    token = n_features + graph.n_layers * graph.n_pos + 3
    return [across[0], within[0], (logit, token)], where


def test_head_parts_sum_to_the_edge(tiny_llama, case):
    tc, graph = case
    edges, where = _edges(graph)
    for index, (target, source) in enumerate(edges):
        split = edge_heads(tiny_llama, tc, graph, target, source)
        expected = float(graph.adjacency_matrix[target, source])
        assert split.edge == pytest.approx(expected, abs=1e-5)
        assert split.residual + float(split.heads.sum()) == pytest.approx(expected, abs=1e-5)
        if index == 0:   # across positions only heads carry it
            assert split.residual == 0.0 and split.heads.abs().sum() > 0
        if index == 1:
            assert split.residual != 0.0
    table = split.table()
    assert table.contribution.abs().is_monotonic_decreasing and set(table.columns) == {"layer", "head", "contribution", "share"}


def test_qk_parts_sum_to_the_score(tiny_llama, case):
    tc, graph = case
    _, cache = tiny_llama.run_with_cache(graph.input_tokens[None])
    for layer, head, query, key in ((0, 1, 7, 2), (2, 0, 5, 0)):
        qk = attention_qk(tiny_llama, tc, graph, layer, head, query, key)
        score = float(cache[f"blocks.{layer}.attn.hook_attn_scores"][0, head, query, key])
        assert float(qk.matrix.sum()) == pytest.approx(score, abs=1e-5) and qk.score == pytest.approx(score, abs=1e-5)
        assert qk.matrix.shape == (len(qk.query_labels), len(qk.key_labels))
        assert float(qk.query_parts.sum()) == pytest.approx(score, abs=1e-5)
        assert float(qk.key_parts.sum()) == pytest.approx(score, abs=1e-5)
    assert any(label.startswith("L0 F") for label in qk.query_labels) and "attn L1" in qk.query_labels
    assert "error L1" in qk.key_labels


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(3)
    model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=6, n_heads=1, d_vocab=9, n_ctx=8, act_fn="relu",
                                      normalization="RMS", attn_bias=True))
    tc = wb.TranscoderSet(W_enc=[model.W_in[0].T.detach()], b_enc=[model.b_in[0].detach()], threshold=[None],
                          W_dec=[model.W_out[0][:, None].detach()], b_dec=model.b_out.detach(),
                          feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out")
    tokens = [1, 4, 2, 7]
    graph = attribute(model, tc, tokens, max_n_logits=1, progress=False)
    _, cache = model.run_with_cache(torch.tensor([tokens]))
    return model, tc, graph, cache, {k: v.detach() for k, v in model.tl_state_dict().items()}


def test_one_head_edge_by_hand(toy):
    model, tc, graph, cache, weights = toy
    source_pos, last = 1, 3
    token_node, logit_node = graph.n_nodes - 1 - graph.n_pos + source_pos, graph.n_nodes - 1
    e = model.W_E[graph.input_tokens[source_pos]].detach()                             # the token node writes W_E[token]
    dn = e / cache["blocks.0.ln1.hook_scale"][0, source_pos] * weights["blocks.0.ln1.w"]
    dz = cache["blocks.0.attn.hook_pattern"][0, 0, last, source_pos] * (dn @ model.W_V[0, 0])
    d_final = (dz @ model.W_O[0, 0]) / cache["ln_final.hook_scale"][0, last] * weights["ln_final.w"]
    token = graph.logit_token_ids[0]
    by_hand = float((d_final @ (model.W_U[:, token] - model.W_U.mean(1))).detach())
    split = edge_heads(model, tc, graph, logit_node, token_node)
    assert split.residual == 0.0
    assert float(split.heads[0, 0]) == pytest.approx(by_hand, abs=1e-5)
    assert float(graph.adjacency_matrix[logit_node, token_node]) == pytest.approx(by_hand, abs=1e-5)


def test_one_head_qk_by_hand(toy):
    model, tc, graph, cache, weights = toy
    query, key = 3, 1
    x = cache["blocks.0.hook_resid_pre"][0]

    def normed(pos):
        return x[pos] / cache["blocks.0.ln1.hook_scale"][0, pos] * weights["blocks.0.ln1.w"]

    q, k = normed(query) @ model.W_Q[0, 0], normed(key) @ model.W_K[0, 0]
    bq, bk = model.b_Q[0, 0], model.b_K[0, 0]
    by_hand = torch.stack([torch.stack([q @ k, q @ bk]), torch.stack([bq @ k, bq @ bk])]) / model.cfg.d_head ** 0.5
    qk = attention_qk(model, tc, graph, 0, 0, query, key)
    assert qk.query_labels == ["embedding", "bias"] and qk.key_labels == ["embedding", "bias"]
    torch.testing.assert_close(qk.matrix, by_hand.detach(), atol=1e-5, rtol=0)
    assert qk.score == pytest.approx(float(cache["blocks.0.attn.hook_attn_scores"][0, 0, query, key]), abs=1e-6)


def test_bad_nodes_and_positions_are_named(toy):
    model, tc, graph, _, _ = toy
    with pytest.raises(InputError, match="logit node, which is no source"):
        edge_heads(model, tc, graph, graph.n_nodes - 1, graph.n_nodes - 1)
    with pytest.raises(InputError, match="no target"):
        edge_heads(model, tc, graph, graph.n_nodes - 2, 0)
    with pytest.raises(InputError, match="target must be a node index"):
        edge_heads(model, tc, graph, 10_000, 0)
    with pytest.raises(InputError, match="masked"):
        attention_qk(model, tc, graph, 0, 0, 1, 3)
    with pytest.raises(InputError, match="head must be"):
        attention_qk(model, tc, graph, 0, 1, 3, 1)
