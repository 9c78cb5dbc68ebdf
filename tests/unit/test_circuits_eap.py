"""The circuit graph, ``blocks.{l}.hook_mlp_in`` and edge attribution patching (EAP, EAP-IG).

Expected values come from hand counts (the graph), the model's own unedited activations (hook_mlp_in is a copy
of the MLP's input) or gradients the test takes itself with autograd (GQA); TransformerLens's scores are in
tests/integration/test_circuits_reference.py.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from experiments.circuits import circuit_graph, edge_attribution_patching
from experiments.metrics import LogitDiff, PromptBatch
from tests.unit.helpers import make_model
from workbench.errors import InputError

TOKENS = torch.randint(0, 61, (3, 7), generator=torch.Generator().manual_seed(3))
CORRUPT = TOKENS.clone()
CORRUPT[:, [1, 4]] = torch.randint(0, 61, (3, 2), generator=torch.Generator().manual_seed(4))
METRIC = LogitDiff(torch.tensor([5, 9, 11]), torch.tensor([7, 3, 20]))


def test_graph_counts_by_hand_parallel_blocks_and_refusals():
    graph = circuit_graph(make_model("mha_learned_ln"))  # 2 layers x 4 heads with MLPs
    assert len(graph.writers) == 1 + 2 * 5 and len(graph.readers) == 2 * 13 + 1
    # layer 0: 12 head inputs x 1 writer, its MLP x 5; layer 1: 12 x 6, MLP x 10; logits x 11
    assert graph.n_edges == 12 + 5 + 72 + 10 + 11
    parallel = circuit_graph(make_model("mha_learned_ln", parallel_attn_mlp=True))
    assert parallel.n_edges == 12 + 1 + 72 + 6 + 11  # a layer's heads do not feed its own MLP
    with pytest.raises(InputError, match="not an edge"):
        parallel.edge_index("a0.h1->m0")
    with pytest.raises(InputError, match="norm_placement is 'post'"):
        circuit_graph(make_model("sinusoidal_postnorm"))


def test_hook_mlp_in_is_the_mlps_own_copy_of_its_input():
    model = make_model("mha_learned_ln")
    names = ["blocks.1.hook_mlp_in", "blocks.1.hook_resid_mid", "blocks.1.hook_resid_post", "blocks.1.hook_mlp_out"]
    logits, cache = model.run_with_cache(TOKENS, names_filter=names)
    torch.testing.assert_close(logits, model(TOKENS), rtol=0, atol=0)  # observing it changes nothing
    torch.testing.assert_close(cache[names[0]], cache[names[1]], rtol=0, atol=0)
    shift = torch.randn(model.cfg.d_model)
    with model.hooks(fwd_hooks=[(names[0], lambda x, hook: x + shift)]):
        _, edited = model.run_with_cache(TOKENS, names_filter=names)
    # the residual stream passes unedited; only the MLP reads the shifted input
    torch.testing.assert_close(edited[names[2]] - edited[names[3]], cache[names[1]], atol=1e-6, rtol=1e-6)
    with model.hooks(fwd_hooks=[(names[1], lambda x, hook: x + shift)]):
        _, whole = model.run_with_cache(TOKENS, names_filter=names)
    torch.testing.assert_close(edited[names[3]], whole[names[3]], atol=1e-6, rtol=1e-6)


def test_eap_ig_with_one_step_is_eap_and_steps_change_the_scores():
    model = make_model("mha_learned_ln")
    eap = edge_attribution_patching(model, TOKENS, CORRUPT, METRIC)
    one = edge_attribution_patching(model, TOKENS, CORRUPT, METRIC, method="eap-ig", ig_steps=1)
    torch.testing.assert_close(one.scores, eap.scores, rtol=0, atol=0)
    five = edge_attribution_patching(model, TOKENS, CORRUPT, METRIC, method="eap-ig", ig_steps=5)
    assert not torch.allclose(five.scores, eap.scores)
    assert eap.to_frame().shape[0] == TOKENS.shape[1] * eap.graph.n_edges


def test_a_padded_batch_gives_the_mean_of_single_pairs():
    model = make_model("gqa_rotary_rms_swiglu")
    lengths = [7, 5, 4]
    mask = torch.arange(7)[None] < torch.tensor(lengths)[:, None]
    positions = torch.tensor(lengths) - 1
    metric = LogitDiff(METRIC.answer_tokens, METRIC.wrong_tokens)
    batched = edge_attribution_patching(model, TOKENS, CORRUPT, metric, method="eap-ig", ig_steps=2,
                                        clean_mask=mask, corrupt_mask=mask, batch_size=2)
    singles = torch.zeros_like(batched.scores)
    for b, n in enumerate(lengths):
        one = edge_attribution_patching(model, TOKENS[b:b + 1, :n], CORRUPT[b:b + 1, :n],
                                        LogitDiff(METRIC.answer_tokens[b:b + 1], METRIC.wrong_tokens[b:b + 1]),
                                        method="eap-ig", ig_steps=2)
        singles[:n] += one.scores / len(lengths)
    torch.testing.assert_close(batched.scores, singles, atol=1e-5, rtol=1e-4)
    assert positions.tolist() == PromptBatch(TOKENS, mask).last_positions.tolist()


def test_grouped_query_edges_are_per_query_head_and_sum_to_the_groups_gradient():
    model = make_model("gqa_rotary_rms_swiglu")  # 4 query heads over 2 key/value heads
    scores = edge_attribution_patching(model, TOKENS, CORRUPT, METRIC)
    graph = scores.graph
    key = lambda h: graph.reader_index(f"a1.h{h}<k>")  # noqa: E731
    writer = graph.writer_index("a0.h2")
    per_head = scores.scores[:, writer, [key(h) for h in range(4)]]  # [P, 4]
    assert not torch.allclose(per_head[:, 0], per_head[:, 1])  # heads 0 and 1 share a key head, not an edge
    # by hand: the grouped model's gradient at its key/value head's input, dotted with the writer's difference
    model.set_use_split_qkv_input(True)
    saved = {}
    with model.hooks(fwd_hooks=[("blocks.1.hook_k_input", lambda x, hook: saved.setdefault("k", x))]):
        grad = torch.autograd.grad(METRIC.values(model(CORRUPT), PromptBatch(CORRUPT)).sum() / 3, saved["k"])[0]
    _, clean = model.run_with_cache(TOKENS, names_filter="blocks.0.attn.hook_result")
    _, corrupt = model.run_with_cache(CORRUPT, names_filter="blocks.0.attn.hook_result")
    delta = (clean["blocks.0.attn.hook_result"] - corrupt["blocks.0.attn.hook_result"])[:, :, 2]
    group = torch.einsum("bpd,bpgd->pg", delta, grad)  # [P, 2 key/value heads]
    torch.testing.assert_close(per_head.view(-1, 2, 2).sum(-1), group, atol=1e-5, rtol=1e-4)
    assert not model.cfg.ungroup_grouped_query_attention  # the switches come back as they were
