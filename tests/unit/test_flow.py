"""Information flow routes (experiments.flow) against hand calculations.

The decomposition is checked against ``hook_attn_out`` and against a loop over heads written here from
``hook_pattern``, ``hook_v`` and ``W_O``; the importance against the proximity formula written out; the
graph against tiny contribution tables whose kept edges are listed by hand.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import workbench as wb
from experiments import flow
from experiments.flow import FlowContributions
from experiments.flow_tables import FlowTables
from experiments.plots.flow import flow_figure
from tests.unit.helpers import make_model

EPS = 1e-5  # the method's floor for a proximity (llm-transparency-tool's get_contributions)
LATENT = dict(n_key_value_heads=4, d_head=12, rotary_dim=4, d_head_v=10, kv_lora_rank=16, q_lora_rank=20)
# (variant, overrides): GQA, MQA, biases with ALiBi, MoE, attention-only, parallel blocks, sinks, latent attention.
MODELS = {
    "gqa": ("gqa_rotary_rms_swiglu", {}),
    "mqa": ("mqa_partial_rotary", {}),
    "bias_alibi": ("alibi_gelu_new", {}),
    "moe": ("moe_gqa", {}),
    "attn_only": ("attn_only_tied", {}),
    "parallel": ("mha_learned_ln", dict(parallel_attn_mlp=True, attn_bias=True)),
    "sinks": ("gqa_rotary_rms_swiglu", dict(attn_sinks=True, attn_bias=True)),
    "latent": ("gqa_rotary_rms_swiglu", LATENT),
}
TOKENS = torch.tensor([[3, 17, 5, 41, 17, 9, 22]])


def model_of(name: str) -> wb.Decoder:
    variant, overrides = MODELS[name]
    return make_model(variant, **overrides)


def full_cache(model, tokens=TOKENS):
    with torch.no_grad():
        return model.run_with_cache(tokens)[1]


# ---- the decomposition ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
@torch.no_grad()
def test_sources_and_heads_sum_to_the_attention_output(name):
    model = model_of(name)
    cache, flow_cache = full_cache(model), flow.run_flow_cache(model, TOKENS)
    for layer in range(model.cfg.n_layers):
        c_PSHD = flow.attention_by_source(model, flow_cache, layer)
        b_O = model.blocks[layer].attn.b_O
        total_PD = c_PSHD.sum((1, 2)) + (b_O if b_O is not None else 0)
        torch.testing.assert_close(total_PD, cache[f"blocks.{layer}.hook_attn_out"][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gqa", "mqa", "latent", "bias_alibi"])
@torch.no_grad()
def test_each_source_equals_a_loop_over_heads(name):
    model = model_of(name)
    cache = full_cache(model)
    layer = 1
    attn = model.blocks[layer].attn
    pattern, v = cache[f"blocks.{layer}.attn.hook_pattern"][0], cache[f"blocks.{layer}.attn.hook_v"][0]
    H, kv_heads = pattern.shape[0], v.shape[1]
    c_PSHD = flow.attention_by_source(model, flow.run_flow_cache(model, TOKENS), layer)
    for i in range(TOKENS.shape[1]):
        for j in range(TOKENS.shape[1]):
            expected = torch.zeros(model.cfg.d_model)
            for h in range(H):
                kv = h // (H // kv_heads)  # query head h reads key/value head h // group size
                head = pattern[h, i, j] * v[j, kv] @ attn.W_O[h]
                torch.testing.assert_close(c_PSHD[i, j, h], head, atol=1e-6, rtol=1e-5)
                expected += head
            torch.testing.assert_close(c_PSHD[i, j].sum(0), expected, atol=1e-5, rtol=1e-5)
            if j > i:
                assert c_PSHD[i, j].abs().max() == 0  # causal: no later source


# ---- the importance rule ---------------------------------------------------------------------------
def test_importance_of_three_vectors_is_the_proximity_formula():
    a, b, c = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]), torch.tensor([-1.0, 1.0])
    whole = a + b + c  # [0, 3], ||whole||_1 = 3
    # ||whole - a||_1 = 1 + 3 = 4 -> 3 - 4 < 0 -> EPS;  ||whole - b||_1 = 0 + 1 = 1 -> 2;  ||whole - c||_1 = 1 + 2 -> 0 -> EPS
    total = EPS + 2.0 + EPS
    expected = torch.tensor([EPS / total, 2.0 / total, EPS / total])
    torch.testing.assert_close(flow.importance(torch.stack([a, b, c]), whole), expected)
    # batched over cases: each case normalised on its own
    parts = torch.tensor([[[1.0, 1.0], [2.0, 0.0]], [[1.0, -1.0], [0.0, 0.0]]])  # [2 parts, 2 cases, D]
    whole2 = parts.sum(0)  # [[2, 0], [2, 0]]
    # case 0: ||w||=2, parts [1,1] -> |1|+|-1| = 2 -> EPS; [1,-1] -> 2 -> EPS: equal halves
    # case 1: parts [2,0] -> 0 -> 2; [0,0] -> 2 -> EPS
    expected2 = torch.tensor([[0.5, 2 / (2 + EPS)], [0.5, EPS / (2 + EPS)]])
    torch.testing.assert_close(flow.importance(parts, whole2), expected2)


@torch.no_grad()
def _hand_importances(model, layer: int, tokens=TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention [P, S, H], residual [P]) of a sequential block with an MLP, by the formula, one target at a time."""
    cache = full_cache(model, tokens)
    attn = model.blocks[layer].attn
    pattern, v = cache[f"blocks.{layer}.attn.hook_pattern"][0], cache[f"blocks.{layer}.attn.hook_v"][0]
    pre, mid = cache[f"blocks.{layer}.hook_resid_pre"][0], cache[f"blocks.{layer}.hook_resid_mid"][0]
    H, kv_heads, P = pattern.shape[0], v.shape[1], tokens.shape[1]
    prox = lambda part, whole: max(float(whole.abs().sum() - (whole - part).abs().sum()), EPS)  # noqa: E731
    attn_PSH, resid_P = torch.zeros(P, P, H), torch.zeros(P)
    for i in range(P):
        raw = {(j, h): prox(pattern[h, i, j] * v[j, h // (H // kv_heads)] @ attn.W_O[h], mid[i])
               for j in range(i + 1) for h in range(H)}
        resid = prox(pre[i], mid[i])
        total = sum(raw.values()) + resid
        for (j, h), value in raw.items():
            attn_PSH[i, j, h] = value / total
        resid_P[i] = resid / total
    return attn_PSH, resid_P


@pytest.mark.parametrize("chunk", [flow.CHUNK_ELEMENTS, 100])  # 100: one target per chunk
def test_contributions_equal_the_formula_written_out(monkeypatch, chunk):
    monkeypatch.setattr(flow, "CHUNK_ELEMENTS", chunk)
    model = model_of("gqa")
    contributions = flow.flow_contributions(model, TOKENS)
    cache = full_cache(model)
    for layer in range(model.cfg.n_layers):
        attn_PSH, resid_P = _hand_importances(model, layer)
        torch.testing.assert_close(contributions.attn_LPSH[layer], attn_PSH, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(contributions.attn_resid_LP[layer], resid_P, atol=1e-5, rtol=1e-4)
        mid, out = cache[f"blocks.{layer}.hook_resid_mid"][0], cache[f"blocks.{layer}.hook_mlp_out"][0]
        post = cache[f"blocks.{layer}.hook_resid_post"][0]
        for i in range(TOKENS.shape[1]):
            mlp = max(float(post[i].abs().sum() - (post[i] - out[i]).abs().sum()), EPS)
            resid = max(float(post[i].abs().sum() - (post[i] - mid[i]).abs().sum()), EPS)
            # a difference of two L1 norms: float32 rounding of the norms (~1e-6 of them) is the tolerance
            assert contributions.mlp_LP[layer, i] == pytest.approx(mlp / (mlp + resid), abs=1e-5)
            assert contributions.mlp_resid_LP[layer, i] == pytest.approx(resid / (mlp + resid), abs=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_sum_is_shared_out_in_full(name):
    model = model_of(name)
    c = flow.flow_contributions(model, TOKENS)
    L, P = model.cfg.n_layers, TOKENS.shape[1]
    assert c.attn_LPSH.shape == (L, P, P, model.cfg.n_heads)
    attention_sum = c.attn_LPSH.sum((2, 3)) + c.attn_resid_LP + c.attn_bias_LP
    if c.parallel:
        attention_sum = attention_sum + c.mlp_LP  # one sum: residual, sources, bias and the MLP
        assert c.mlp_resid_LP is None
    elif c.mlp_LP is not None:
        torch.testing.assert_close(c.mlp_LP + c.mlp_resid_LP, torch.ones(L, P))
    else:
        assert name == "attn_only" and c.mlp_resid_LP is None
    torch.testing.assert_close(attention_sum, torch.ones(L, P))
    assert (c.attn_LPSH.permute(0, 3, 1, 2).triu(diagonal=1) == 0).all()  # no edge from a later source
    has_bias = model.cfg.attn_bias
    assert bool((c.attn_bias_LP > 0).all()) == has_bias and bool((c.attn_bias_LP == 0).all()) == (not has_bias)
    nodes, edges = flow.flow_graph(c, -1, 0.04)
    assert f"L{L - 1}.post:{P - 1}" in set(nodes["node"]) and len(edges) > 0


def test_registered_models_run():
    """The zoo's GQA mixture of experts and attention-only model (a tiny random one where not installed)."""
    models = wb.list_models()
    for name in ("toy-moe-2l", "toy-attn-2l"):
        if not bool(models.loc[models["name"] == name, "installed"].any()):
            pytest.skip(f"{name} is not installed")
        model = wb.load_model(name).eval()
        c = flow.flow_contributions(model, model.to_tokens("The cat sat on the mat."))
        nodes, edges = flow.flow_graph(c)
        assert (c.mlp_LP is None) == model.cfg.attn_only
        assert set(edges["kind"]) <= ({"attention", "residual"} if model.cfg.attn_only else
                                      {"attention", "residual", "mlp", "mlp_in"})
        assert (nodes["stage"] == "mlp").any() == (edges["kind"] == "mlp").any()
        assert (nodes["stage"] == "mid").any() == (not model.cfg.attn_only)


# ---- the graph: tiny hand-made tables ----------------------------------------------------------------------
def _contributions(attn, attn_resid, mlp=None, mlp_resid=None, parallel=False, n_tokens=3) -> FlowContributions:
    t = lambda x: None if x is None else torch.tensor(x, dtype=torch.float32)  # noqa: E731
    attn_LPSH = t(attn)
    tables = FlowTables.from_tables(attn_LPSH, t(attn_resid), torch.zeros(attn_LPSH.shape[:2]), t(mlp), t(mlp_resid),
                                    parallel)
    return FlowContributions(tables, parallel, [f"t{i}" for i in range(n_tokens)])


def _edge_set(edges: pd.DataFrame) -> set[tuple[str, str, str]]:
    return set(zip(edges["kind"], edges["source"], edges["target"]))


def test_graph_keeps_exactly_the_edges_above_the_threshold_reachable_from_the_token():
    # attention-only, 2 layers, 3 positions, 2 heads; each row (layer, target) sums to one with its residual
    z = [0.0, 0.0]
    attn = [
        # layer 0, targets 0..2: target 1 is strong but never reached
        [[[0.6, 0.25], z, z], [[0.9, 0.0], z, z], [[0.1, 0.1], [0.3, 0.0], z]],
        # layer 1: targets 0 and 1 are strong but not reached from position 2
        [[[0.3, 0.3], z, z], [[0.5, 0.4], z, z], [[0.1, 0.15], [0.05, 0.05], [0.2, 0.15]]],
    ]
    attn_resid = [[0.15, 0.1, 0.5], [0.4, 0.1, 0.3]]
    c = _contributions(attn, attn_resid)
    nodes, edges = flow.flow_graph(c, position=-1, threshold=0.2)
    # layer 1, target 2: residual 0.3 kept; sources 0 (0.1 + 0.15 = 0.25: kept although no head reaches 0.2),
    # 1 (0.1 dropped), 2 (0.35 kept). Layer 1's targets 0 and 1 are not reached.
    # layer 0, target 2: residual 0.5, source 1 (0.3), source 0 (0.2, equal to the threshold: kept);
    # target 0: source 0 (0.85) kept, residual 0.15 dropped.
    expected = {("residual", "L0.post:2", "L1.post:2"), ("attention", "L0.post:0", "L1.post:2"),
                ("attention", "L0.post:2", "L1.post:2"), ("residual", "embed:2", "L0.post:2"),
                ("attention", "embed:1", "L0.post:2"), ("attention", "embed:0", "L0.post:2"),
                ("attention", "embed:0", "L0.post:0")}
    assert _edge_set(edges) == expected and len(edges) == len(expected)
    assert set(nodes["node"]) == {"L1.post:2", "L0.post:2", "L0.post:0", "embed:2", "embed:1", "embed:0"}
    row = edges[(edges.source == "L0.post:0") & (edges.target == "L1.post:2")].iloc[0]
    assert row.importance == pytest.approx(0.25) and row.top_head == 1 and row.heads == "H1 0.150, H0 0.100"
    assert list(edges["importance"]) == sorted(edges["importance"], reverse=True)
    # a lower threshold reaches more; position 0 reaches only its own column
    assert _edge_set(flow.flow_graph(c, position=0, threshold=0.2)[1]) == {
        ("attention", "L0.post:0", "L1.post:0"), ("residual", "L0.post:0", "L1.post:0"),
        ("attention", "embed:0", "L0.post:0")}
    everything = flow.flow_graph(c, position=-1, threshold=0.0)[1]  # every causal edge below position 2
    # layer 1 into target 2: residual + 3 sources; layer 0 into targets 0, 1, 2: (1 + 1) + (1 + 2) + (1 + 3)
    assert len(everything) == 4 + 2 + 3 + 4 and (everything.source_position <= everything.target_position).all()


def test_graph_through_a_sequential_mlp():
    # 1 layer, 2 positions, 1 head. At target 1: MLP 0.6 and its residual 0.4 kept; attention from 0 (0.5) kept,
    # from 1 (0.25) and the attention residual (0.25) dropped at 0.3.
    c = _contributions(attn=[[[[1.0], [0.0]], [[0.5], [0.25]]]], attn_resid=[[0.0, 0.25]],
                       mlp=[[0.5, 0.6]], mlp_resid=[[0.5, 0.4]], n_tokens=2)
    nodes, edges = flow.flow_graph(c, position=1, threshold=0.3)
    assert _edge_set(edges) == {("mlp", "L0.mlp:1", "L0.post:1"), ("mlp_in", "L0.mid:1", "L0.mlp:1"),
                                ("residual", "L0.mid:1", "L0.post:1"), ("attention", "embed:0", "L0.mid:1")}
    assert dict(zip(nodes["node"], nodes["block"])) == {"L0.post:1": "mlp", "L0.mlp:1": "mlp", "L0.mid:1": "attn",
                                                        "embed:0": ""}
    # neither the MLP nor its residual reaches 0.7: nothing below the final state is reachable
    nodes, edges = flow.flow_graph(c, position=1, threshold=0.7)
    assert edges.empty and list(nodes["node"]) == ["L0.post:1"]


def test_graph_through_a_parallel_block():
    # one sum: residual 0.3, MLP 0.35, sources 0.2 and 0.15 (dropped at 0.3); the MLP reads the block input
    c = _contributions(attn=[[[[0.5], [0.0]], [[0.2], [0.15]]]], attn_resid=[[0.2, 0.3]], mlp=[[0.3, 0.35]],
                       parallel=True, n_tokens=2)
    _, edges = flow.flow_graph(c, position=-1, threshold=0.3)
    assert _edge_set(edges) == {("mlp", "L0.mlp:1", "L0.post:1"), ("mlp_in", "embed:1", "L0.mlp:1"),
                                ("residual", "embed:1", "L0.post:1")}


def test_edge_heads_and_figure_point_at_graph_items():
    model = model_of("gqa")
    c = flow.flow_contributions(model, TOKENS)
    nodes, edges = flow.flow_graph(c, -1, 0.01)
    top = edges[edges.kind == "attention"].iloc[0]
    heads = flow.edge_heads(c, int(top.layer), int(top.target_position), int(top.source_position))
    assert heads["importance"].sum() == pytest.approx(top.importance, rel=1e-5)
    assert int(heads["head"].iloc[0]) == top.top_head
    fig = flow_figure(nodes, edges, c.str_tokens, c.n_layers)
    clickable = {trace.name: list(trace.customdata) for trace in fig.data if trace.customdata is not None}
    assert clickable["nodes"] == list(nodes["node"])
    assert clickable["edges"] == list(edges.loc[edges["kind"] == "attention", "edge"])  # a block's edge: its node
    assert list(fig.layout.yaxis.ticktext) == ["embed", "L0", "L1"]
    # Every edge is one segment from its source node to its target node (NaN ends each), in one line trace per
    # colour and width: MLP-in and MLP edges, drawn alike, share theirs.
    lines = [trace for trace in fig.data if trace.mode == "lines"]
    assert {trace.name for trace in lines} <= {"attention", "residual", "mlp"}
    assert len({(trace.name, trace.line.width) for trace in lines}) == len(lines)
    where = {node: (x, y) for node, x, y in zip(fig.data[-1].customdata, fig.data[-1].x, fig.data[-1].y)}
    segments = []
    for trace in lines:
        xs, ys = np.asarray(trace.x, float), np.asarray(trace.y, float)
        ends = np.flatnonzero(np.isnan(xs))
        starts = np.concatenate([[0], ends[:-1] + 1])
        segments += [((xs[a], ys[a]), (xs[e - 1], ys[e - 1])) for a, e in zip(starts, ends)]
    expected = [(where[a], where[b]) for a, b in zip(edges["source"], edges["target"])]
    assert sorted(segments) == sorted(expected)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_graph_splits_only_the_sums_it_reaches_and_equals_the_graph_of_the_whole_tables(name):
    model = model_of(name)
    whole = flow.flow_contributions(model, TOKENS)
    whole.attn_LPSH  # read whole: every row split
    assert bool(whole.tables.filled_LP.all())
    for position, threshold in ((-1, 0.04), (-1, 0.01), (2, 0.0)):
        lazy = flow.flow_contributions(model, TOKENS)
        assert not bool(lazy.tables.filled_LP.any())   # nothing split before a graph reads it
        nodes, edges = flow.flow_graph(lazy, position, threshold)
        expected_nodes, expected_edges = flow.flow_graph(whole, position, threshold)
        pd.testing.assert_frame_equal(nodes, expected_nodes)
        pd.testing.assert_frame_equal(edges, expected_edges, rtol=1e-6, atol=1e-7)
        filled = lazy.tables.filled_LP
        if position == 2:   # no target after the traced token is reached
            assert bool(filled[:, :3].any()) and not bool(filled[:, 3:].any())
        for table in ("attn_LPSH", "attn_resid_LP", "attn_bias_LP") + (("mlp_LP",) if model.cfg.parallel_attn_mlp
                                                                       else ()):
            torch.testing.assert_close(getattr(lazy.tables, table)[filled], getattr(whole.tables, table)[filled],
                                       rtol=1e-6, atol=1e-7)
        for top in edges[edges["kind"] == "attention"].head(1).itertuples():   # threshold 0: always one
            args = (int(top.layer), int(top.target_position), int(top.source_position))
            pd.testing.assert_frame_equal(flow.edge_heads(lazy, *args), flow.edge_heads(whole, *args))
    lazy = flow.flow_contributions(model, TOKENS)
    flow.edge_heads(lazy, 1, 5, 2)   # one edge's heads: one row split
    assert lazy.tables.filled_LP.nonzero().tolist() == [[1, 5]]
    torch.testing.assert_close(lazy.attn_LPSH, whole.attn_LPSH, rtol=1e-6, atol=1e-7)   # the rest on reading it whole


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_patterns_come_from_the_same_forward_and_equal_attention_patterns(name):
    from experiments.attention import attention_patterns

    model = model_of(name)
    forwards = []
    model.hook_dict["hook_embed"].add_hook(lambda a, hook: forwards.append(1), level=None, is_permanent=True)
    try:
        c = flow.flow_contributions(model, TOKENS)
    finally:
        model.reset_hooks(including_permanent=True)
    assert len(forwards) == 1   # the importances and the patterns: one forward pass
    with torch.no_grad():
        expected_LHPS = attention_patterns(model, TOKENS)   # its own forward, hooked the same way
    assert c.patterns_LHPS.shape == (model.cfg.n_layers, model.cfg.n_heads, TOKENS.shape[1], TOKENS.shape[1])
    torch.testing.assert_close(c.patterns_LHPS, expected_LHPS, rtol=0, atol=1e-7)


@torch.no_grad()
def test_vocab_projection_is_the_block_output_through_the_frozen_final_norm():
    model = model_of("gqa")  # RMS final norm: out / scale * w, then W_U
    cache = full_cache(model)
    layer, position = 0, 4
    table = flow.vocab_projection(model, TOKENS, layer, position, "mlp", k=3)
    out = cache[f"blocks.{layer}.hook_mlp_out"][0, position]
    scale = cache["ln_final.hook_scale"][0, position]
    logits = (out / scale * model.ln_final.w) @ model.W_U
    promoted, suppressed = table[table.direction == "promoted"], table[table.direction == "suppressed"]
    assert list(promoted["token_id"]) == logits.topk(3).indices.tolist()
    assert list(suppressed["token_id"]) == (-logits).topk(3).indices.tolist()
    torch.testing.assert_close(torch.tensor(promoted["effect"].tolist()), logits.topk(3).values, atol=1e-5, rtol=1e-5)


# ---- errors --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("position", [7, -8, 2.5, True])
def test_bad_position_is_an_input_error(position):
    c = flow.flow_contributions(model_of("gqa"), TOKENS)
    with pytest.raises(wb.InputError, match="position must be a whole number in -7..6"):
        flow.flow_graph(c, position=position)


@pytest.mark.parametrize("threshold", [-0.1, 1.5, "0.1", None])
def test_bad_threshold_is_an_input_error(threshold):
    c = flow.flow_contributions(model_of("gqa"), TOKENS)
    with pytest.raises(wb.InputError, match="threshold must be a number in 0..1"):
        flow.flow_graph(c, threshold=threshold)


def test_post_norm_models_batches_and_bad_blocks_are_refused():
    with pytest.raises(wb.InputError, match=r"post-norm, ln\(x \+ f\(x\)\)"):
        flow.flow_contributions(make_model("sinusoidal_postnorm"), TOKENS)
    model = model_of("attn_only")
    with pytest.raises(wb.InputError, match="one prompt"):
        flow.flow_contributions(model, TOKENS.repeat(2, 1))
    with pytest.raises(wb.InputError, match="block must be one of"):
        flow.vocab_projection(model, TOKENS, 0, -1, "mlp")
    with pytest.raises(wb.InputError, match="outside"):
        flow.vocab_projection(model, TOKENS, 5, -1, "attn")
    with pytest.raises(wb.InputError, match="no attention edge"):
        flow.edge_heads(flow.flow_contributions(model, TOKENS), 0, 1, 3)
