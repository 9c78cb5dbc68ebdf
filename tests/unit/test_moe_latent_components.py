"""Routers, shared experts, clamped SwiGLU, multi-head latent attention and attention sinks.

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
from workbench.errors import ConfigError, InputError
from workbench.generation import KVCache, generate_tokens

VOCAB = 53
BASE = dict(n_layers=2, d_model=32, n_heads=4, d_vocab=VOCAB, n_ctx=48, positional="rotary",
            normalization="RMS", gated_mlp=True, act_fn="silu")

# Routers of the families, at toy sizes.
SOFTMAX = dict(n_key_value_heads=2, num_experts=6, experts_per_token=2)  # Mixtral, Qwen2/3-MoE
SIGMOID = dict(num_experts=8, experts_per_token=3, router_scoring="sigmoid", router_score_correction=True,
               router_groups=4, router_topk_groups=2, router_group_score="top2_sum", routed_scaling_factor=2.5,
               d_shared_expert=24)  # DeepSeek-V3
GROUP_MAX = dict(num_experts=8, experts_per_token=3, router_groups=4, router_topk_groups=2, router_group_score="max",
                 router_renormalize=False, routed_scaling_factor=16.0, d_shared_expert=24)  # DeepSeek-V2
TOPK_SOFTMAX = dict(n_key_value_heads=2, num_experts=6, experts_per_token=2, router_scoring="topk_softmax",
                    router_bias=True, expert_bias=True, swiglu_limit=1.5, swiglu_alpha=1.702,
                    attn_sinks=True, attn_bias=True)  # gpt-oss
QWEN_SHARED = dict(SOFTMAX, router_renormalize=False, d_shared_expert=24, shared_expert_gate=True)  # Qwen2-MoE
# Attention: sinks (a sliding window in layer 0, as gpt-oss alternates), and latent attention with
# d_head_v != d_head (K = 12: U = 8 without RoPE, R = 4 with it).
SINKS = dict(n_key_value_heads=2, attn_sinks=True, attn_bias=True, layer_overrides=({"sliding_window": 3}, {}))
LATENT = dict(n_key_value_heads=4, d_head=12, rotary_dim=4, d_head_v=10, kv_lora_rank=16, q_lora_rank=20)


def build(seed: int = 0, **fields) -> wb.Decoder:
    """A model with gains ~N(1, 0.2), every bias, sink and correction bias ~N(0, 0.3) and matrices ~N(0, 0.2)."""
    torch.manual_seed(seed)
    model = wb.Decoder(wb.ModelConfig.from_dict({**BASE, **fields}), attn_impl="eager")  # flat names, as saved
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "w":
                param.normal_(1.0, 0.2)
            elif leaf == "b" or leaf.startswith(("b_", "_b_")) or leaf in ("sinks", "router_score_correction"):
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 0.2)
    return model.eval()


def tokens_BP(batch: int = 2, pos: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, pos), generator=torch.Generator().manual_seed(seed))


def run_recording(model: wb.Decoder, tokens: torch.Tensor, names: list[str], edits=(), **kwargs):
    """(logits, {name: activation}) with ``edits`` (hook name, fn) applied; reads after the edits."""
    seen: dict[str, torch.Tensor] = {}

    def record(tensor, hook):
        seen[hook.name] = tensor.detach().clone()

    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=list(edits) + [(n, record) for n in names], **kwargs)
    return logits, seen


def snapshot(model: wb.Decoder):
    return model.cfg, {name: t.detach().clone() for name, t in model.state_dict().items()}


def assert_unchanged(model: wb.Decoder, before) -> None:
    cfg, state = before
    assert model.cfg == cfg
    after = model.state_dict()
    assert set(after) == set(state)
    assert all(torch.equal(after[name], state[name]) for name in state)


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


# ---- config errors name their field ------------------------------------------------------------------------
@pytest.mark.parametrize("fields, field", [
    (dict(num_experts=8, experts_per_token=2, router_groups=2, router_topk_groups=3), "moe.router_topk_groups"),
    (dict(num_experts=8, experts_per_token=2, router_scoring="sparsemax"), "moe.router_scoring"),
    (dict(n_key_value_heads=2, kv_lora_rank=16), "n_key_value_heads"),
    (dict(num_experts=8, experts_per_token=5, router_groups=4, router_topk_groups=2), "experts_per_token"),
])
def test_config_errors_name_their_field(fields, field):
    with pytest.raises(ConfigError, match=rf"ModelConfig\.{field}\b"):
        wb.ModelConfig.from_dict({**BASE, **fields})


# ---- weight processing and the weight API: refusals change nothing -----------------------------------------
STEPS_OFF = dict(fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False)


@pytest.mark.parametrize("steps", [dict(STEPS_OFF, fold_ln=True), {}])
def test_fold_ln_refuses_latent_attention(steps):
    model = build(**LATENT)
    before = snapshot(model)
    with pytest.raises(ConfigError, match=r"fold_ln.*kv_lora_rank=16"):
        model.process_weights_(**steps)
    assert_unchanged(model, before)


def test_latent_attention_takes_the_steps_it_can():
    model = build(**LATENT)
    tokens = tokens_BP()
    with torch.no_grad():
        expected = model(tokens).log_softmax(-1)
        model.process_weights_(**dict(STEPS_OFF, center_unembed=True, fold_value_biases=True))
        got = model(tokens).log_softmax(-1)
    assert model.cfg.weight_processing == ("center_unembed", "fold_value_biases")
    assert (got - expected).abs().max() < 1e-4


def test_fold_value_biases_refuses_sinks_with_a_value_bias():
    model = build(**SINKS)
    before = snapshot(model)
    with pytest.raises(ConfigError, match=r"fold_value_biases.*attn_sinks.*layer\(s\) \[0, 1\]"):
        model.process_weights_(**dict(STEPS_OFF, fold_value_biases=True))
    assert_unchanged(model, before)
    # A LayerNorm model without attention biases: fold_ln would create b_V from ln1.b, so the pair is refused ...
    ln_model = build(**dict(SINKS, attn_bias=False, normalization="LN"))
    before = snapshot(ln_model)
    with pytest.raises(ConfigError, match=r"fold_value_biases.*attn_sinks"):
        ln_model.process_weights_(**dict(STEPS_OFF, fold_ln=True, fold_value_biases=True))
    assert_unchanged(ln_model, before)
    # ... while fold_ln alone is right (the sink logits read no weights) and keeps the logits.
    tokens = tokens_BP()
    with torch.no_grad():
        expected = ln_model(tokens)
        ln_model.process_weights_(**dict(STEPS_OFF, fold_ln=True))
        assert (ln_model(tokens) - expected).abs().max() < 1e-4
    # With every value bias zero there is nothing to fold, and the step goes through.
    with torch.no_grad():
        for block in model.blocks:
            block.attn._b_V_lin.zero_()
        expected = model(tokens)
        model.process_weights_(**dict(STEPS_OFF, fold_value_biases=True))
        assert (model(tokens) - expected).abs().max() < 1e-5


def test_fold_ln_folds_into_router_experts_and_the_gated_shared_expert_of_mixed_layers():
    """A dense first layer, then a sigmoid router with correction, groups, router and expert biases and a
    gated shared expert: folding ln2's gain must reach every reader (the logits stay, ln2.w becomes one)."""
    model = build(**dict(SIGMOID, router_bias=True, expert_bias=True, shared_expert_gate=True,
                  layer_overrides=({"num_experts": 0, "experts_per_token": 0}, {})))
    assert model.cfg.moe_layers == [1]
    tokens = tokens_BP()
    with torch.no_grad():
        expected = model(tokens)
        model.process_weights_(**dict(STEPS_OFF, fold_ln=True))
        got = model(tokens)
    assert (got - expected).abs().max() < 1e-4
    assert all(bool((block.ln2.w == 1).all()) for block in model.blocks)


def test_center_writing_weights_centres_expert_and_shared_expert_outputs_over_d_model():
    model = build(**dict(QWEN_SHARED, normalization="LN", expert_bias=True, mlp_bias=True))
    tokens = tokens_BP()
    with torch.no_grad():
        expected = model(tokens)
        model.process_weights_(**dict(STEPS_OFF, center_writing_weights=True))
        got = model(tokens)
    assert (got - expected).abs().max() < 1e-4
    for block in model.blocks:
        moe = block.mlp
        assert moe.b_out.mean(-1).abs().max() < 1e-6  # each expert's [d_model] bias, not across experts
        assert moe.W_out.mean(-1).abs().max() < 1e-6
        assert moe.shared.W_out.mean(-1).abs().max() < 1e-6 and moe.shared.b_out.mean().abs() < 1e-6


def test_fold_ln_refuses_a_layernorm_bias_before_a_mixture_with_router_and_expert_biases():
    model = build(**dict(SOFTMAX, normalization="LN", router_bias=True, expert_bias=True))
    before = snapshot(model)
    with pytest.raises(ConfigError, match=r"fold_ln: the LayerNorm bias ln2\.b \(nonzero in layer\(s\) \[0, 1\]\).*"
                                          r"router_bias=True, expert_bias=True.*not implemented"):
        model.process_weights_(**dict(STEPS_OFF, fold_ln=True))
    assert_unchanged(model, before)


@pytest.mark.parametrize("name", ["W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "QK", "OV"])
def test_latent_attention_has_no_per_head_qkv_weights(name):
    model = build(**LATENT)
    before = snapshot(model)
    with pytest.raises(InputError, match=rf"model\.{name}: .*kv_lora_rank=16.*no per-head linear W_K/W_V.*hook_k"):
        getattr(model, name)
    assert_unchanged(model, before)


def test_latent_attention_w_o_is_per_head_over_d_head_v():
    model = build(**LATENT)
    W_O = model.W_O
    assert W_O.shape == (2, 4, 10, 32)
    z_BPHJ = torch.randn(1, 3, 4, 10)
    for layer, block in enumerate(model.blocks):  # z W_O summed over heads is the output projection
        by_hand = torch.einsum("bphj,hjd->bpd", z_BPHJ, W_O[layer])
        torch.testing.assert_close(by_hand, F.linear(z_BPHJ.flatten(-2), block.attn._W_O_lin), atol=1e-5, rtol=1e-5)
    assert model.b_O.shape == (2, 32)


def test_stacks_over_dense_and_expert_layers_and_expert_biases_are_refused_by_name():
    model = build(**dict(SOFTMAX, expert_bias=True, layer_overrides=({"num_experts": 0, "experts_per_token": 0}, {})))
    with pytest.raises(InputError, match=r"model\.W_in: .*layer\(s\) \[0\]: \[32, 128\]; layer\(s\) \[1\]: "
                                         r"\[6, 32, 128\].*moe_layers=\[1\]"):
        model.W_in
    with pytest.raises(InputError, match=r"accumulated_bias: layer 1's experts have output biases "
                                         r"\(expert_bias=True\)"):
        model.accumulated_bias(2)
    assert model.accumulated_bias(2, include_mlp_biases=False).shape == (32,)
