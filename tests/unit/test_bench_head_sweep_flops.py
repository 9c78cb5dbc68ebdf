"""The head-sweep benchmark's FLOP counts and time split, against counts made by hand from the configuration."""

import pytest
import torch

from tests.benchmarks.bench_head_sweep import (LOSS_PART, PROFILE_PARTS, REST_PART, profile_sweep, sweep_flops,
                                               weight_flops_per_token)
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


def test_time_split_covers_every_part_and_counts_each_matmul_by_hand():
    model = make_model("gqa_rotary_rms_swiglu")  # 2 layers, 4 query heads and 2 KV heads of 8, d_mlp 128, vocab 61
    tokens = torch.randint(0, 61, (1, 6))
    rows = {row["part"]: row for row in profile_sweep(model, tokens, matmul_flops_per_s=1e9)}
    # Token-blocks: the unedited run's 6 tokens through both blocks, then the staircase's 5 positions (the last
    # is not run) for 4 heads through 2 blocks (layer 0) and 4 through 1 (layer 1).
    token_blocks = 6 * 2 + 4 * 5 * 2 + 4 * 5 * 1
    by_hand = {"q projection": 32 * 32, "k, v projections": 2 * 32 * 16, "o projection": 32 * 32,
               "gate, up projections": 2 * 32 * 128, "down projection": 128 * 32}
    for part, weights in by_hand.items():
        assert rows[part]["weight_GFLOP"] == pytest.approx(2 * weights * token_blocks / 1e9)
    # The loss: the unedited run's 5 predictions and each of the 8 heads' 5.
    assert rows[LOSS_PART]["weight_GFLOP"] == pytest.approx(2 * 32 * 61 * 5 * 9 / 1e9)
    for _, part, _ in PROFILE_PARTS:
        assert rows[part]["seconds"] > 0, part  # each part's hook points were reached
    whole = rows.pop("whole sweep (timed by this split)")
    assert rows[REST_PART]["seconds"] >= 0
    assert sum(row["seconds"] for row in rows.values()) == pytest.approx(whole["seconds"])
    # Nothing is left on the model: no timing loss, no hook point storing anywhere.
    assert "loss_from_resid" not in vars(model)
    assert all(point.cache_into is None for point in model.hook_dict.values())
