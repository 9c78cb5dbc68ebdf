"""Exact edge patching, batched, against the model's own hooks; EAP-IG's convergence on a linear edge.

Expected values: runs of the model with its reader input (``hook_k_input``, ``hook_mlp_in``, the last
``hook_resid_post``) replaced wholesale by the clean run's (TransformerLens-style hooks the test writes itself),
single-edge runs one at a time, and (EAP-IG) the exact effect of an edge whose effect is linear by construction.
"""

from __future__ import annotations

import pytest
import torch

from experiments.circuits import circuit_graph, edge_attribution_patching, edge_patching
from experiments.circuits.exact import edge_masks
from experiments.metrics import LogitDiff, PromptBatch
from tests.unit.helpers import make_model
from workbench.errors import InputError

TOKENS = torch.randint(0, 61, (3, 7), generator=torch.Generator().manual_seed(3))
CORRUPT = TOKENS.clone()
CORRUPT[:, [1, 4]] = torch.randint(0, 61, (3, 2), generator=torch.Generator().manual_seed(4))
METRIC = LogitDiff(torch.tensor([5, 9, 11]), torch.tensor([7, 3, 20]))


def on_device(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The clean and corrupted tokens where ``model`` is (``tests/gpu`` runs these checks on CUDA)."""
    return TOKENS.to(model.cfg.device), CORRUPT.to(model.cfg.device)


def wholesale(model, hook_name, head=None):
    """The metric of the corrupted run with ``hook_name`` (one head's copy) replaced by the clean run's."""
    tokens, corrupt = on_device(model)
    model.set_use_split_qkv_input(True)
    _, clean = model.run_with_cache(tokens, names_filter=hook_name)

    def patch(x, hook):
        x = x.clone()
        if head is None:
            return clean[hook_name]
        x[:, :, head] = clean[hook_name][:, :, head]
        return x

    with torch.no_grad(), model.hooks(fwd_hooks=[(hook_name, patch)]):
        value = METRIC.values(model(corrupt), PromptBatch(corrupt)).mean()
    model.set_use_split_qkv_input(False)
    return float(value)


def assert_every_edge_into_a_reader_patches_its_input_wholesale(model, atol: float = 1e-5) -> None:
    graph = circuit_graph(model)
    tokens, corrupt = on_device(model)
    for reader, hook_name, head in [("a1.h2<k>", "blocks.1.hook_k_input", 2), ("m1", "blocks.1.hook_mlp_in", None),
                                    ("logits", "blocks.1.hook_resid_post", None)]:
        r = graph.reader_index(reader)
        edges = graph.edge_names(graph.edge_mask & (torch.arange(len(graph.readers)) == r)[None])
        table = edge_patching(model, tokens, corrupt, METRIC, edges, together=True)
        assert abs(table["metric"][0] - wholesale(model, hook_name, head)) < atol, reader


def assert_batched_edges_equal_one_at_a_time(model, atol: float = 1e-5) -> None:
    graph = circuit_graph(model)
    tokens, corrupt = on_device(model)
    edges = graph.edge_names(graph.edge_mask)[::25] + [("a0.h1", "a1.h3<v>", 4)]
    batched = edge_patching(model, tokens, corrupt, METRIC, edges, batch_size=2).set_index(["edge", "position"])
    for edge in edges:
        one = edge_patching(model, tokens, corrupt, METRIC, [edge])
        assert abs(batched.loc[(one["edge"][0], one["position"][0]), "metric"] - one["metric"][0]) < atol


def test_all_edges_into_one_reader_patch_its_input_wholesale():
    assert_every_edge_into_a_reader_patches_its_input_wholesale(make_model("mha_learned_ln"))


@pytest.mark.parametrize("variant, overrides", [("moe_gqa", {}), ("alibi_gelu_new", {"parallel_attn_mlp": True})])
def test_mixture_of_experts_and_parallel_blocks_rebuild_the_mlp_input(variant, overrides):
    model = make_model(variant, **overrides)  # the parallel block's MLP reads the block input: no same-layer heads
    graph = circuit_graph(model)
    r = graph.reader_index("m1")
    edges = graph.edge_names(graph.edge_mask & (torch.arange(len(graph.readers)) == r)[None])
    assert len(edges) == 1 + 4 + 1 + (0 if overrides else 4)
    table = edge_patching(model, TOKENS, CORRUPT, METRIC, edges, together=True)
    assert abs(table["metric"][0] - wholesale(model, "blocks.1.hook_mlp_in")) < 1e-5


def test_batched_edges_equal_one_at_a_time_and_grouped_query_heads_patch_apart():
    model = make_model("gqa_rotary_rms_swiglu")
    assert_batched_edges_equal_one_at_a_time(model)
    # heads 2 and 3 share a key/value head, but an edge into head 2's key moves head 2 alone
    two, three = (edge_patching(model, TOKENS, CORRUPT, METRIC, [f"a0.h1->a1.h{h}<k>"])["delta"][0] for h in (2, 3))
    assert abs(two - three) > 1e-6


def test_eap_ig_converges_to_exact_patching_on_a_linear_edge():
    """One layer: heads that write nothing (W_O = 0) and an MLP; the final norm's scale frozen (a hook returns a
    constant), so the metric is linear in the final residual stream. Then the edge input -> m0 moves the metric by
    u . (mlp(clean) - mlp(corrupt)) exactly, and EAP-IG's integral along the inputs is that same quantity, its
    left Riemann sum approaching it as the steps grow."""
    model = make_model("mha_learned_ln", n_layers=1)
    with torch.no_grad():
        model.blocks[0].attn.W_O.zero_()
        for name, param in model.named_parameters():
            if ".mlp." in name:  # a large MLP output, so the edge's effect is far from zero
                param.mul_(10)
    hooks = [("ln_final.hook_scale", lambda scale, hook: torch.ones_like(scale))]
    corrupt = CORRUPT.clone()
    corrupt[:, -1] = (TOKENS[:, -1] + 1) % 61  # without attention only the read position's own token matters
    errors = []
    with model.hooks(fwd_hooks=hooks):
        exact = edge_patching(model, TOKENS, corrupt, METRIC, ["input->m0"])["delta"][0]
        for steps in (1, 4, 32):
            scores = edge_attribution_patching(model, TOKENS, corrupt, METRIC, method="eap-ig", ig_steps=steps)
            graph = scores.graph
            errors.append(abs(float(scores.summed()[graph.edge_index("input->m0")]) - exact))
    assert abs(exact) > 1e-2
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.05 * abs(exact)


def test_passes_keep_their_token_and_difference_budgets_and_variants_enter_in_order():
    """A pass holds at most 2,048 tokens and 2**28 bytes of writer differences [n, tokens, patched writers, D] in
    float32, one variant at the least (budgets by hand below). Each variant of these three patches its own writer."""
    from experiments.circuits import runs

    model = make_model("gqa_rotary_rms_swiglu")
    graph = circuit_graph(model)
    masks, _, _ = edge_masks(graph, ["a0.h1->a1.h3<v>", "input->a0.h0<q>", "a0.h0->logits"], 7)
    assert runs._pass_chunks(masks, [0, 1, 2], 21, 128) == [[0, 1, 2]]  # far from both budgets: one pass
    assert runs._pass_chunks(masks, [0, 1, 2], 1000, 128) == [[0, 1], [2]]  # 3 x 1,000 tokens > 2,048
    assert runs._pass_chunks(masks, [0, 1, 2], 5000, 128) == [[0], [1], [2]]  # alone over the budget, still run
    # 4 bytes x 2 variants x 1 token x 2 writers x 2**24 = 2**28 fits; x 3 x 3 is over
    assert runs._pass_chunks(masks, [0, 1, 2], 1, 2**24) == [[0, 1], [2]]
    batch = PromptBatch(TOKENS)
    with runs.edge_switches(model):
        start = runs.base_run(model, graph, batch)
    with pytest.raises(InputError, match="first_layers must not decrease"):
        runs.patch_hooks(graph, batch, masks, start.writers, start, [1, 0, 2])


def test_variants_entering_at_different_blocks_share_one_staircase_pass():
    """Edges into a0 (entering at block 0), a1 (block 1) and the logits (no block): the last block runs once in each
    unedited run (clean and corrupted) and once for the staircase pass of the first two."""
    model = make_model("mha_learned_ln")
    calls = []
    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_post", lambda x, hook: calls.append(x.shape[0]))]):
        table = edge_patching(model, TOKENS, CORRUPT, METRIC, ["input->a0.h0<q>", "a0.h1->a1.h3<v>", "a1.h2->logits"])
    assert sorted(calls) == [3, 3, 6]  # two unedited runs of 3 pairs; the two variants stacked
    assert len(table) == 3
