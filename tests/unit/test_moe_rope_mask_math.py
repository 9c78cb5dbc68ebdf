"""The math of the chunked-attention, longrope and newer routing families, each against a hand calculation or transformers' own function: the chunked
attention mask, longrope's frequencies and attention factor, and the routing rows (top-k sigmoid,
renormalising with a floor, the weight on the expert's input)."""

from __future__ import annotations

import math

import pytest
import torch

from workbench.components.attention_kernels import MaskSpec, eager_attention, sdpa_attention, tiled_flash_attention
from workbench.components.moe import MixtureOfExperts, RoutingRule
from workbench.components.rotary import inverse_frequencies
from workbench.config import ModelConfig, MoEConfig
from workbench.options import RuntimeOptions

NEG = float("-inf")


def test_chunked_mask_is_causal_within_chunks_counted_from_each_rows_first_real_token():
    visible = MaskSpec(scale=1.0, chunk_size=2).bias(0, 4, 0, 4, torch.device("cpu"))[0, 0] == 0
    assert visible.tolist() == [[True, False, False, False], [True, True, False, False],
                                [False, False, True, False], [False, False, True, True]]
    padded = torch.tensor([[False, True, True, True]])  # one pad: the row's positions are -1, 0, 1, 2
    visible = MaskSpec(scale=1.0, chunk_size=2, key_mask_BS=padded).bias(0, 4, 0, 4, torch.device("cpu"))[0, 0] == 0
    assert visible[1:, 1:].tolist() == [[True, False, False], [True, True, False], [False, False, True]]


def test_chunked_mask_is_the_same_under_every_kernel_and_with_a_cache_offset():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4)
    mask = MaskSpec(scale=0.5, chunk_size=3)
    eager = eager_attention(q, k, v, mask)
    assert torch.allclose(sdpa_attention(q, k, v, mask), eager, atol=1e-6)
    assert torch.allclose(tiled_flash_attention(q, k, v, mask, block_q=2, block_k=2), eager, atol=1e-6)
    last = eager_attention(q[:, :, -1:], k, v, MaskSpec(scale=0.5, chunk_size=3, q_offset=6))
    assert torch.allclose(last, eager[:, -1:], atol=1e-6)  # position 6 sees key 6 only (chunk 6..8)


def test_longrope_frequencies_equal_transformers():
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    short, long = [1.0, 1.5, 2.0, 4.0], [2.0, 3.0, 5.0, 9.0]
    config = Phi3Config(hidden_size=32, num_attention_heads=4, max_position_embeddings=64,
                        original_max_position_embeddings=16,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                                         "long_factor": long})
    spec = (("factor", 4.0), ("long_factor", tuple(long)), ("original_max_position_embeddings", 16),
            ("rope_type", "longrope"), ("short_factor", tuple(short)))
    for seq_len in (10, 17):
        theirs, their_factor = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=seq_len)
        ours, our_factor = inverse_frequencies(8, 10000.0, spec, n_ctx=64, seq_len=seq_len)
        assert torch.allclose(ours.float(), theirs, rtol=1e-6)
        assert our_factor == pytest.approx(their_factor) == pytest.approx(math.sqrt(1 + math.log(4) / math.log(16)))


def test_topk_sigmoid_routing_and_renormalising_floor_by_hand():
    indices, weights = RoutingRule(k=2, scoring="topk_sigmoid").choose(torch.tensor([[[0.0, 2.0, 1.0, -1.0]]]))
    assert indices.tolist() == [[[1, 2]]]
    assert torch.allclose(weights, torch.sigmoid(torch.tensor([[[2.0, 1.0]]])))
    logits = torch.tensor([[[0.0, 0.0]]])  # softmax 0.5 each: the top one's 0.5 over the floor 2.0
    _, weights = RoutingRule(k=1, renormalize_floor=2.0).choose(logits)
    assert weights.item() == pytest.approx(0.25)


def test_weight_on_the_expert_input_is_expert_of_weighted_input():
    cfg = ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=4, d_mlp=6, num_experts=4,
                      experts_per_token=1, gated_mlp=True, act_fn="silu",
                      moe=MoEConfig(router_scoring="topk_sigmoid", router_renormalize=False, router_weights_input=True))
    moe = MixtureOfExperts(cfg, RuntimeOptions())
    torch.manual_seed(0)
    for param in moe.parameters():
        param.data.normal_()
    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        out = moe(x)
        index = moe.router_logits(x).argmax(-1)
        weight = torch.sigmoid(moe.router_logits(x).amax(-1))
        expected = torch.stack([moe.expert_forward(int(index[0, t]), x[0, t:t + 1] * weight[0, t]) for t in range(3)])
    assert torch.allclose(out[0], expected[:, 0], atol=1e-6)
