"""Each component against an independent hand computation."""

import math

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.unit.helpers import make_model
from workbench.components import GatedMLP, LayerNorm, MixtureOfExperts, RMSNorm, Rotary
from workbench.components.embedding import sinusoidal_table
from workbench.components.rotary import alibi_slopes
from workbench.options import RuntimeOptions

CFG = wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=10, n_ctx=64, d_mlp=24)


def test_rope_dot_product_depends_only_on_relative_offset():
    rotary = Rotary(CFG.replace(positional="rotary"))
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(m, n):
        qm = rotary(q, torch.tensor([m]))
        kn = rotary(k, torch.tensor([n]))
        return (qm * kn).sum().item()

    assert score(3, 7) == pytest.approx(score(20, 24), abs=1e-5)
    assert score(0, 5) == pytest.approx(score(30, 35), abs=1e-5)
    assert score(3, 7) != pytest.approx(score(3, 8), abs=1e-3)


def test_rope_rotates_pairs_i_and_i_plus_half_by_hand_angle():
    rotary = Rotary(CFG.replace(positional="rotary", rotary_base=100.0))
    x = torch.zeros(1, 1, 1, 8)
    x[..., 1] = 1.0  # pair (1, 5), frequency 100^(-2*1/8)
    out = rotary(x, torch.tensor([3]))[0, 0, 0]
    angle = 3 * 100 ** (-2 / 8)
    assert out[1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert out[5].item() == pytest.approx(math.sin(angle), abs=1e-6)


def test_partial_rotary_leaves_tail_dimensions_alone():
    rotary = Rotary(CFG.replace(positional="rotary", rotary_dim=4))
    x = torch.randn(2, 5, 2, 8)
    out = rotary(x, torch.arange(5))
    torch.testing.assert_close(out[..., 4:], x[..., 4:])
    assert not torch.allclose(out[:, 1:, :, :4], x[:, 1:, :, :4])


def test_rmsnorm_formula():
    norm = RMSNorm(CFG, RuntimeOptions())
    with torch.no_grad():
        norm.w.copy_(torch.linspace(0.5, 2.0, 16))
    x = torch.randn(2, 3, 16)
    rms = [[math.sqrt(sum(v * v for v in x[b, p].tolist()) / 16 + CFG.norm_eps) for p in range(3)] for b in range(2)]
    expected = x / torch.tensor(rms)[..., None] * torch.linspace(0.5, 2.0, 16)
    torch.testing.assert_close(norm(x), expected)


def test_layernorm_formula():
    norm = LayerNorm(CFG, RuntimeOptions())
    with torch.no_grad():
        norm.w.copy_(torch.linspace(0.5, 2.0, 16))
        norm.b.copy_(torch.linspace(-1, 1, 16))
    x = torch.randn(4, 16) * 3 + 1
    mean = x.sum(-1, keepdim=True) / 16
    var = ((x - mean) ** 2).sum(-1, keepdim=True) / 16  # biased variance, as in the paper
    expected = (x - mean) / torch.sqrt(var + CFG.norm_eps) * norm.w + norm.b
    torch.testing.assert_close(norm(x[None])[0], expected)


def test_swiglu_is_silu_gate_times_linear():
    mlp = GatedMLP(CFG.replace(gated_mlp=True, act_fn="silu"), RuntimeOptions())
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 2, 16)
    gate, up = x @ mlp.W_gate, x @ mlp.W_in  # TransformerLens layout: W_gate, W_in [d_model, d_mlp]
    expected = (gate * (1 / (1 + torch.exp(-gate))) * up) @ mlp.W_out  # W_out [d_mlp, d_model]
    torch.testing.assert_close(mlp(x), expected)


def test_pattern_rows_sum_to_one_and_are_causal():
    model = make_model("alibi_gelu_new")
    _, cache = model.run_with_cache(torch.randint(0, 61, (2, 9)), names_filter=lambda n: n.endswith("hook_pattern"))
    for name in cache.keys():
        pattern = cache[name]
        torch.testing.assert_close(pattern.sum(-1), torch.ones(2, 4, 9))
        assert torch.triu(pattern, diagonal=1).abs().max() == 0


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_equals_per_token_loop_over_chosen_experts(renormalize):
    cfg = CFG.replace(num_experts=4, experts_per_token=2, gated_mlp=True, act_fn="silu",
                      moe=wb.MoEConfig(router_renormalize=renormalize))
    moe = MixtureOfExperts(cfg, RuntimeOptions())
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, 16)
    out = moe(x)
    for b in range(2):
        for t in range(5):
            xt = x[b, t]
            probs = torch.softmax(xt @ moe.W_router, dim=-1)  # W_router [d_model, num_experts]
            chosen = sorted(range(4), key=lambda e: -probs[e].item())[:2]
            total = sum(probs[e] for e in chosen)
            expected = torch.zeros(16)
            for e in chosen:
                hidden = F.silu(xt @ moe.W_gate[e]) * (xt @ moe.W_in[e])  # [E, d_model, d_mlp]
                weight = probs[e] / total if renormalize else probs[e]
                expected += weight * (hidden @ moe.W_out[e])  # [E, d_mlp, d_model]
            torch.testing.assert_close(out[b, t], expected, atol=1e-5, rtol=1e-5)


def test_sinusoidal_table_by_hand():
    table = sinusoidal_table(10, 6)
    p, i = 7, 1
    assert table[p, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / 6)), abs=1e-6)
    assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / 6)), abs=1e-6)


def test_alibi_slopes_match_paper_for_8_heads():
    assert alibi_slopes(8).tolist() == pytest.approx([2 ** -(i + 1) for i in range(8)])


def test_alibi_scores_carry_linear_distance_penalty():
    model = make_model("alibi_gelu_new", attn_impl="eager")
    _, cache = model.run_with_cache(torch.randint(0, 61, (1, 6)))
    attn = model.blocks[0].attn
    q, k = cache["blocks.0.attn.hook_q"][0], cache["blocks.0.attn.hook_k"][0]  # [P, H, K]
    raw = torch.einsum("qhk,shk->hqs", q, k) / model.cfg.attn_scale
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    expected = raw - attn.alibi_slopes_H[:, None, None] * (i - j)
    scores = cache["blocks.0.attn.hook_attn_scores"][0]
    visible = (j <= i).expand(4, 6, 6)
    torch.testing.assert_close(scores[visible], expected[visible])
