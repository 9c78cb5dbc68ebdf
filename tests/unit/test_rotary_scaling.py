"""RoPE frequencies and cos/sin factors of every scaling type equal transformers' own
(``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``), and adjacent-pair rotation is GPT-J's."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from workbench.components.rotary import inverse_frequencies, rotated

HEAD_DIM, N_CTX, BASE = 16, 64, 500.0
SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.707, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 16, "attention_factor": 1.3,
     "truncate": False},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("seq_len", [None, 3 * N_CTX])
def test_inverse_frequencies_equal_transformers(scaling, seq_len):
    config = LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=N_CTX,
                         rope_parameters={"rope_theta": BASE, **scaling})
    expected_inv, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", seq_len=seq_len)
    ours_inv, ours_factor = inverse_frequencies(HEAD_DIM, BASE, tuple(sorted(scaling.items())), N_CTX,
                                                seq_len or 0)
    assert torch.allclose(ours_inv.float(), expected_inv, rtol=1e-6, atol=0)
    assert ours_factor == pytest.approx(expected_factor, rel=1e-6)
    if scaling["rope_type"] == "dynamic" and seq_len:
        assert not torch.allclose(ours_inv, inverse_frequencies(HEAD_DIM, BASE)[0]), "the NTK base should grow"


def test_adjacent_pairs_rotate_like_gptj():
    """GPT-J's apply_rotary_pos_emb (rotate_every_two: (-x1, x0, -x3, x2, ...)), its sin and cos per pair."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb

    x, angles = torch.randn(2, 3, 4, 8), torch.rand(2, 3, 4) * 6
    expected = apply_rotary_pos_emb(x, angles.sin(), angles.cos())
    cos, sin = (f(angles).repeat_interleave(2, -1)[:, :, None] for f in (torch.cos, torch.sin))
    torch.testing.assert_close(rotated(x, cos, sin, adjacent_pairs=True), expected, rtol=0, atol=1e-6)


def test_half_pairs_rotate_like_llama():
    """Llama's apply_rotary_pos_emb (rotate_half: (x1, x2) -> (-x2, x1)) on [batch, heads, pos, head_dim]."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, angles = torch.randn(2, 4, 3, 8), torch.randn(2, 1, 3, 8), torch.rand(2, 3, 4) * 6
    cos, sin = (f(angles).repeat(1, 1, 2) for f in (torch.cos, torch.sin))   # [batch, pos, head_dim]
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    for x, expected in ((q, expected_q), (k, expected_k)):
        torch.testing.assert_close(rotated(x, cos[:, None], sin[:, None]), expected, rtol=0, atol=1e-6)
