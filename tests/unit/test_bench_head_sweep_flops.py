"""The head-sweep benchmark's FLOP counts, against counts made by hand from the configuration."""

from tests.benchmarks.bench_head_sweep import sweep_flops, weight_flops_per_token
from tests.unit.helpers import make_model


def test_weight_flops_count_every_weight_matrix_of_a_gated_gqa_block():
    model = make_model("gqa_rotary_rms_swiglu")  # d_model 32, 4 query heads and 2 KV heads of 8, d_mlp 128
    q_and_o = 2 * 32 * 4 * 8
    k_and_v = 2 * 32 * 2 * 8
    gate_in_out = 3 * 32 * 128
    assert weight_flops_per_token(model) == (2 * (q_and_o + k_and_v + gate_in_out), 2 * 61 * 32)


def test_weight_flops_of_an_ungated_mha_block():
    model = make_model("mha_learned_ln")
    assert weight_flops_per_token(model)[0] == 2 * (4 * 32 * 32 + 2 * 32 * 128)


def test_sweep_flops_by_hand_for_two_layers():
    model = make_model("gqa_rotary_rms_swiglu")
    block, unembed = weight_flops_per_token(model)
    batch, pos = 3, 10
    # Loop: 2 x 4 heads, each a full forward over 30 tokens.
    assert sweep_flops(model, batch, pos)[0] == 8 * 30 * (2 * block + unembed)
    # Staircase, 27 tokens (the last position left out): layer-0 heads run both blocks, layer-1 heads one.
    assert sweep_flops(model, batch, pos)[1] == 4 * 27 * (2 * block + unembed) + 4 * 27 * (block + unembed)
