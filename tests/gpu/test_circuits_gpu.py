"""Circuits on CUDA (skipped without CUDA): exact edge patching and EAP keep their tensors on the model's device.

Expected values: the corrupted run with one reader's input replaced wholesale by the clean run's, through the
model's own hooks on the same GPU (what every edge into that reader patched together must give), single edges
patched one at a time there, and EAP's scores from the same weights on the CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from experiments.circuits import circuit_graph, edge_attribution_patching, edge_patching
from experiments.metrics import LogitDiff, PromptBatch
from tests.unit.helpers import make_model

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOKENS = torch.randint(0, 61, (3, 7), generator=torch.Generator().manual_seed(3))
CORRUPT = TOKENS.clone()
CORRUPT[:, [1, 4]] = torch.randint(0, 61, (3, 2), generator=torch.Generator().manual_seed(4))
METRIC = LogitDiff(torch.tensor([5, 9, 11]), torch.tensor([7, 3, 20]))


def wholesale(model, hook_name: str, head: int) -> float:
    """The metric of the corrupted run with one head's copy of ``hook_name`` replaced by the clean run's."""
    tokens, corrupt = TOKENS.to(DEVICE), CORRUPT.to(DEVICE)
    model.set_use_split_qkv_input(True)
    try:
        _, clean = model.run_with_cache(tokens, names_filter=hook_name)

        def patch(x, hook):
            x = x.clone()
            x[:, :, head] = clean[hook_name][:, :, head]
            return x

        with torch.no_grad(), model.hooks(fwd_hooks=[(hook_name, patch)]):
            return float(METRIC.values(model(corrupt), PromptBatch(corrupt)).mean())
    finally:
        model.set_use_split_qkv_input(False)


def test_exact_edge_patching_on_cuda_matches_the_hooks_and_single_edges_there():
    tokens, corrupt = TOKENS.to(DEVICE), CORRUPT.to(DEVICE)
    model = make_model("mha_learned_ln").to(DEVICE)  # one key input per head: the hook's head is the edge's
    graph = circuit_graph(model)
    r = graph.reader_index("a1.h2<k>")
    into_reader = graph.edge_names(graph.edge_mask & (torch.arange(len(graph.readers)) == r)[None])
    together = edge_patching(model, tokens, corrupt, METRIC, into_reader, together=True)
    assert abs(together["metric"][0] - wholesale(model, "blocks.1.hook_k_input", 2)) < 1e-4

    model = make_model("gqa_rotary_rms_swiglu").to(DEVICE)
    graph = circuit_graph(model)
    edges = graph.edge_names(graph.edge_mask)[::25] + [("a0.h1", "a1.h3<v>", 4)]
    batched = edge_patching(model, tokens, corrupt, METRIC, edges, batch_size=2).set_index(["edge", "position"])
    for edge in edges:
        one = edge_patching(model, tokens, corrupt, METRIC, [edge])
        assert abs(batched.loc[(one["edge"][0], one["position"][0]), "metric"] - one["metric"][0]) < 1e-4


def test_eap_on_cuda_equals_eap_of_the_same_weights_on_the_cpu():
    cpu_model = make_model("gqa_rotary_rms_swiglu")
    cuda_model = copy.deepcopy(cpu_model).to(DEVICE)
    for method in ("eap", "eap-ig"):
        on_cpu = edge_attribution_patching(cpu_model, TOKENS, CORRUPT, METRIC, method=method, ig_steps=3)
        on_cuda = edge_attribution_patching(cuda_model, TOKENS.to(DEVICE), CORRUPT.to(DEVICE), METRIC, method=method,
                                            ig_steps=3)
        torch.testing.assert_close(on_cuda.scores, on_cpu.scores, rtol=1e-4, atol=1e-4)
