"""Routers, shared experts, clamped SwiGLU, multi-head latent attention and attention sinks (their config errors,
weight processing and weight views: test_moe_latent_weights.py).

Expected values come from hand calculations in this file (plain torch, written out per token), never
from the function under test: a forced expert's output is that expert's MLP times the weight the rule
gives it (worked out here) plus the shared expert computed by hand; routing choices and weights come
from each family's rule written as a loop; the clamped SwiGLU is written out; an edit of the
key/value latent moves keys and values by W_KVB @ delta; sinks are softmax([scores, sink]). Kernels
are compared with eager. Models are small and built from ``ModelConfig`` with every norm gain, bias,
sink and correction bias random (none zero), matrices spread out so routing and patterns are far from ties.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from tests.unit.moe_latent_models import (GROUP_MAX, LATENT, QWEN_SHARED, SIGMOID, SINKS, SOFTMAX, TOPK_SOFTMAX,
                                         build, run_recording, tokens_BP)
from workbench.generation import KVCache, generate_tokens


# ---- routing -------------------------------------------------------------------------------------------
def route_by_hand(logits_E: torch.Tensor, k: int, scoring: str = "softmax", renormalize: bool = True,
                  groups=None, topk_groups=None, group_score: str = "max", scale: float = 1.0, correction=None
                  ) -> dict[int, float]:
    """One token's chosen experts and their weights ({expert: weight}), each family's rule written out."""
    logits = [float(v) for v in logits_E]
    E = len(logits)
    if scoring == "topk_softmax":  # gpt-oss: top-k of the logits, softmax over those
        chosen = sorted(range(E), key=lambda e: -logits[e])[:k]
        exps = [math.exp(logits[e]) for e in chosen]
        return {e: x / sum(exps) * scale for e, x in zip(chosen, exps)}
    if scoring == "softmax":
        total = sum(math.exp(v) for v in logits)
        scores = [math.exp(v) / total for v in logits]
    else:  # sigmoid (DeepSeek-V3)
        scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    choice = [s + (0.0 if correction is None else float(correction[e])) for e, s in enumerate(scores)]
    allowed = list(range(E))
    if groups is not None:
        size = E // groups
        group_scores = []
        for g in range(groups):
            members = sorted(choice[g * size:(g + 1) * size], reverse=True)
            group_scores.append(members[0] if group_score == "max" else members[0] + members[1])
        best = sorted(range(groups), key=lambda g: -group_scores[g])[:topk_groups]
        allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
    chosen = sorted(allowed, key=lambda e: -choice[e])[:k]
    weights = [scores[e] for e in chosen]
    if renormalize:
        weights = [w / sum(weights) for w in weights]
    return {e: w * scale for e, w in zip(chosen, weights)}


def rule_of(cfg: wb.ModelConfig) -> dict:
    return dict(k=cfg.experts_per_token, scoring=cfg.moe.router_scoring, renormalize=cfg.moe.router_renormalize,
                groups=cfg.moe.router_groups, topk_groups=cfg.moe.router_topk_groups, group_score=cfg.moe.router_group_score,
                scale=cfg.moe.routed_scaling_factor)


def shared_by_hand(moe, x_BPD: torch.Tensor) -> torch.Tensor:
    """The shared expert: W_out (silu(x W_gate) * (x W_in)), times sigmoid(x . w_gate) when gated; 0 if none."""
    if moe.shared is None:
        return torch.zeros_like(x_BPD)
    out = (F.silu(x_BPD @ moe.shared.W_gate) * (x_BPD @ moe.shared.W_in)) @ moe.shared.W_out
    if moe._W_shared_gate_lin is not None:
        out = out * torch.sigmoid(x_BPD @ moe._W_shared_gate_lin[0])[..., None]
    return out


FORCED = {"softmax": SOFTMAX, "sigmoid": SIGMOID, "topk_softmax": TOPK_SOFTMAX, "softmax_gated_shared": QWEN_SHARED}


@pytest.mark.parametrize("kind", sorted(FORCED))
def test_editing_router_logits_runs_the_forced_expert(kind):
    """Logit +50 for one expert, -50 for the rest, every token: hook_mlp_out is that expert's MLP times the
    weight the rule gives it (worked out by hand, k=1) plus the shared expert."""
    model = build(**dict(FORCED[kind], experts_per_token=1))
    moe, cfg = model.blocks[1].mlp, model.cfg
    if moe.router_score_correction is not None:  # small enough that +50 still decides, still nonzero
        with torch.no_grad():
            moe.router_score_correction.normal_(0.0, 0.1)
    forced, E = 4, cfg.num_experts

    def force(logits, hook):
        out = torch.full_like(logits, -50.0)
        out[..., forced] = 50.0
        return out

    names = ["blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out", "blocks.1.mlp.hook_expert_indices"]
    tokens = tokens_BP()
    _, clean = run_recording(model, tokens, names)
    assert not bool((clean["blocks.1.mlp.hook_expert_indices"] == forced).all())  # the edit changes something
    _, seen = run_recording(model, tokens, names, edits=[("blocks.1.mlp.hook_router_logits", force)])

    if cfg.moe.router_scoring == "softmax":  # p = e^50 / (e^50 + (E - 1) e^-50), renormalised over one: 1
        weight = 1.0 if cfg.moe.router_renormalize else 1.0 / (1.0 + (E - 1) * math.exp(-100.0))
    else:  # sigmoid over one chosen, renormalised: 1; topk_softmax over one logit: 1
        weight = 1.0
    weight *= cfg.moe.routed_scaling_factor
    x_BPD = seen["blocks.1.ln2.hook_normalized"]
    B, P, D = x_BPD.shape
    expected = weight * moe.expert_forward(forced, x_BPD.reshape(B * P, D)).view(B, P, D)
    expected = expected + shared_by_hand(moe, x_BPD)
    assert bool((seen["blocks.1.mlp.hook_expert_indices"] == forced).all())
    torch.testing.assert_close(seen["blocks.1.hook_mlp_out"], expected, atol=1e-5, rtol=1e-5)


ROUTERS = {
    "deepseek_v3_sigmoid_top2_sum_groups": SIGMOID,
    "deepseek_v2_softmax_max_groups": GROUP_MAX,
    "gpt_oss_topk_softmax": TOPK_SOFTMAX,
    "qwen_softmax_renormalized": SOFTMAX,
    "qwen_softmax_not_renormalized": dict(SOFTMAX, router_renormalize=False),
}


@pytest.mark.parametrize("kind", sorted(ROUTERS))
def test_routing_rules_match_hand_calculation(kind):
    model = build(**ROUTERS[kind])
    moe, cfg = model.blocks[1].mlp, model.cfg
    correction = None
    if moe.router_score_correction is not None:
        with torch.no_grad():
            moe.router_score_correction.normal_(0.0, 0.3)
        correction = moe.router_score_correction.detach().clone()
    tokens = tokens_BP(batch=4, pos=8)
    logits_BPE = torch.randn(4, 8, cfg.num_experts, generator=torch.Generator().manual_seed(3)) * 2.0
    names = ["blocks.1.mlp.hook_expert_indices", "blocks.1.mlp.hook_expert_weights"]
    _, seen = run_recording(model, tokens, names,
                            edits=[("blocks.1.mlp.hook_router_logits", lambda t, hook: logits_BPE.clone())])
    indices_Nk = seen[names[0]].reshape(-1, cfg.experts_per_token)
    weights_Nk = seen[names[1]].reshape(-1, cfg.experts_per_token)

    rule = rule_of(cfg)
    for n, logits_E in enumerate(logits_BPE.reshape(-1, cfg.num_experts)):
        expected = route_by_hand(logits_E, **rule, correction=correction)
        got = dict(zip(indices_Nk[n].tolist(), weights_Nk[n].tolist()))
        assert sorted(got) == sorted(expected), f"token {n}"
        for expert, weight in expected.items():
            assert abs(got[expert] - weight) < 1e-5 * max(1.0, abs(weight)), f"token {n}, expert {expert}"

    # The test exercises what it names: groups and the correction bias change some token's choice.
    all_tokens = logits_BPE.reshape(-1, cfg.num_experts)
    if cfg.moe.router_groups is not None:
        ungrouped = dict(rule, groups=None, topk_groups=None)
        assert any(sorted(route_by_hand(t, **ungrouped, correction=correction)) !=
                   sorted(route_by_hand(t, **rule, correction=correction)) for t in all_tokens)
    if correction is not None:
        assert any(sorted(route_by_hand(t, **rule)) != sorted(route_by_hand(t, **rule, correction=correction))
                   for t in all_tokens)


def test_clamped_swiglu_matches_hand_calculation():
    model = build(**TOPK_SOFTMAX)
    moe, expert, limit, alpha = model.blocks[1].mlp, 2, 1.5, 1.702
    x_ND = torch.randn(20, 32, generator=torch.Generator().manual_seed(4)) * 3.0
    with torch.no_grad():
        gate = x_ND @ moe.W_gate[expert] + moe.b_gate[expert]
        up = x_ND @ moe.W_in[expert] + moe.b_in[expert]
        assert bool((gate > limit).any() and (gate < limit).any() and (up.abs() > limit).any())  # clamping bites
        g = torch.minimum(gate, torch.tensor(limit))
        u = up.clamp(-limit, limit)
        expected = ((u + 1) * g * torch.sigmoid(alpha * g)) @ moe.W_out[expert] + moe.b_out[expert]
        unclamped = ((up + 1) * gate * torch.sigmoid(alpha * gate)) @ moe.W_out[expert] + moe.b_out[expert]
        got = moe.expert_forward(expert, x_ND)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (unclamped - expected).abs().max() > 0.1


# ---- multi-head latent attention -----------------------------------------------------------------------
def test_editing_the_kv_latent_moves_every_heads_keys_and_values_at_that_position_only():
    model = build(**LATENT)
    attn, at = model.blocks[0].attn, 3
    U = attn.d_nope
    delta_A = torch.randn(16, generator=torch.Generator().manual_seed(5))

    def add_delta(latent, hook):
        latent = latent.clone()
        latent[:, at] += delta_A
        return latent

    names = ["blocks.0.attn.hook_k", "blocks.0.attn.hook_v"]
    tokens = tokens_BP()
    _, clean = run_recording(model, tokens, names)
    _, edited = run_recording(model, tokens, names, edits=[("blocks.0.attn.hook_kv_latent", add_delta)])
    k_clean, v_clean = clean[names[0]], clean[names[1]]  # [B, S, H, K], [B, S, H, J]
    k_edit, v_edit = edited[names[0]], edited[names[1]]
    assert k_clean.shape == (2, 7, 4, 12) and v_clean.shape == (2, 7, 4, 10)

    others = [p for p in range(tokens.shape[1]) if p != at]
    assert torch.equal(k_edit[:, others], k_clean[:, others]) and torch.equal(v_edit[:, others], v_clean[:, others])
    # By hand: [k_nope | v] per head moves by W_KVB delta; the rotary part (from W_KVA x, not the latent) stays.
    moved_HX = (attn._W_KVB_lin.detach() @ delta_A).view(4, U + 10)
    torch.testing.assert_close(k_edit[:, at, :, :U] - k_clean[:, at, :, :U], moved_HX[None, :, :U].expand(2, -1, -1),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_edit[:, at] - v_clean[:, at], moved_HX[None, :, U:].expand(2, -1, -1),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(k_edit[:, at, :, U:], k_clean[:, at, :, U:])
    assert bool((moved_HX[:, :U].norm(dim=-1) > 1e-2).all() and (moved_HX[:, U:].norm(dim=-1) > 1e-2).all())


def test_the_kv_cache_holds_the_latent_and_cached_generation_equals_uncached():
    model = build(**LATENT)
    prompt = tokens_BP(batch=2, pos=6)
    steps = tokens_BP(batch=2, pos=3, seed=2)
    with torch.no_grad():
        cache = KVCache(model.cfg.n_layers)
        model(prompt, kv_cache=cache)
        for t in range(steps.shape[1]):
            model(steps[:, t:t + 1], kv_cache=cache)
    _, seen = run_recording(model, torch.cat([prompt, steps], dim=1),
                            [f"blocks.{l}.attn.hook_{n}" for l in range(2) for n in ("kv_latent", "k_rope")])
    for layer in range(2):
        latent, k_rope = cache.layers[layer].k_BGSK, cache.layers[layer].v_BGSK
        assert latent.shape == (2, 1, 9, 16) and k_rope.shape == (2, 1, 9, 4)
        torch.testing.assert_close(latent[:, 0], seen[f"blocks.{layer}.attn.hook_kv_latent"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k_rope[:, 0], seen[f"blocks.{layer}.attn.hook_k_rope"], atol=1e-5, rtol=1e-5)

    cached, cached_logits = generate_tokens(model, prompt, 5, use_kv_cache=True)
    uncached, uncached_logits = generate_tokens(model, prompt, 5, use_kv_cache=False)
    assert cached.tolist() == uncached.tolist()
    assert (cached_logits - uncached_logits).abs().max() < 1e-5


# ---- attention sinks and the kernels --------------------------------------------------------------------
def test_sinks_take_their_softmax_share_under_eager():
    model = build(**SINKS)
    names = [f"blocks.{l}.attn.hook_{n}" for l in range(2) for n in ("attn_scores", "pattern", "sink_weight")]
    _, seen = run_recording(model, tokens_BP(), names)
    for layer in range(2):
        scores, pattern, sink = (seen[f"blocks.{layer}.attn.hook_{n}"]
                                 for n in ("attn_scores", "pattern", "sink_weight"))
        assert sink.shape == (2, 4, 7)
        torch.testing.assert_close(pattern.sum(-1), 1 - sink, atol=1e-6, rtol=0)
        assert float(sink.min()) > 1e-3
        head = 1  # by hand: softmax over [this head's scores (masked), its sink logit]
        sink_logit = model.blocks[layer].attn.sinks[head].detach()
        with_sink = torch.cat([scores[:, head], sink_logit.expand(2, 7, 1)], dim=-1).softmax(-1)
        torch.testing.assert_close(pattern[:, head], with_sink[..., :-1], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(sink[:, head], with_sink[..., -1], atol=1e-6, rtol=1e-6)


def padded(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    tokens = torch.full((len(rows), width), 7, dtype=torch.long)  # 7 is a real word: only the mask hides pads
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        where = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
        tokens[index, where], mask[index, where] = row, 1
    return tokens, mask


def outputs(model: wb.Decoder, scenario: str) -> torch.Tensor:
    """Logits of a plain run, of a padded batch, or of each step of KV-cached decoding after a padded prompt."""
    rows = [tokens_BP(1, n, seed=n)[0] for n in (4, 8, 6)]
    with torch.no_grad():
        if scenario == "plain":
            return model(tokens_BP())
        if scenario in ("padded_left", "padded_right"):
            tokens, mask = padded(rows, scenario.removeprefix("padded_"))
            return model(tokens, attention_mask=mask) * mask[..., None]  # pads' logits are not compared
        tokens, mask = padded(rows, "left")
        cache = KVCache(model.cfg.n_layers)
        logits = [model(tokens, attention_mask=mask, kv_cache=cache)[:, -1]]
        for step in tokens_BP(3, 3, seed=9).T:
            logits.append(model(step[:, None], kv_cache=cache)[:, -1])
        return torch.stack(logits)


@pytest.mark.parametrize("scenario", ["plain", "padded_left", "padded_right", "kv_cache"])
@pytest.mark.parametrize("kernel", ["sdpa", "flash"])
@pytest.mark.parametrize("kind", ["sinks", "latent"])
def test_fast_kernels_equal_eager(kind, kernel, scenario):
    model = build(**(SINKS if kind == "sinks" else LATENT))
    eager = outputs(model.set_attn_impl("eager"), scenario)
    fast = outputs(model.set_attn_impl(kernel), scenario)
    assert (fast - eager).abs().max() < 1e-5
