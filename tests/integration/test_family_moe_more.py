"""More mixture-of-experts families load at parity with transformers (``family_parity``): OLMoE
(QK norm over the projection, clip_qkv), MiniMax-M2 (sigmoid routing with a correction bias, partial
rotary, the hub's ``rotary_dim`` spelling), GLM-4.5 and dots.llm1 (DeepSeek-V3's grouped sigmoid routing,
shared experts, dense first layers), ERNIE 4.5 MoE (softmax plus correction bias, experts every other
layer, biases everywhere), HunYuan MoE (shared MLP, QK norm after RoPE), Phi-3.5-MoE (sparsemixer
routing, LayerNorms, windows) and GraniteMoE / GraniteMoeShared (multipliers, fused experts).

Beyond the shared parity tests, ``test_family_moe``'s router tests run here too: each layer's router
logits, chosen experts and weights equal transformers' own router outputs, and the prompt reaches most
experts. JetMoE is refused by name.

Tiny configs as ``test_family_moe``'s: d_model 48 over 4 heads (2 KV heads), vocab 101, 3 layers, 4-8
experts of width 20.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import workbench as wb
from tests.integration.family_parity import TOLERANCE, Case, family_parity_tests, max_diff, saved_on_demand
from tests.integration.test_family_llama import _copy
from tests.integration.test_padding_parity import padded_batch
from tests.integration.test_family_moe import (test_router_choices_match_transformers,  # noqa: F401 (run here too)
                                               test_the_prompt_exercises_the_routers)
from workbench.components.moe import RoutingRule
from workbench.errors import CheckpointError, ConfigError

TINY = dict(vocab_size=101, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
            intermediate_size=80, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=2)
GROUPED = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=20, first_k_dense_replace=1,
               head_dim=12)
GRANITE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=20, embedding_multiplier=3.0,
               attention_multiplier=0.3, residual_multiplier=0.6, logits_scaling=2.5)


def _config(model_type: str, **fields):
    return lambda: AutoConfig.for_model(model_type, **{**TINY, **fields})


def _as_rotary_dim(config: dict) -> dict:
    """The hub's MiniMax-M2 spelling of partial RoPE: ``rotary_dim``, no partial_rotary_factor."""
    config["rope_parameters"].pop("partial_rotary_factor")
    return {**config, "rotary_dim": 6}


CASES = {
    "olmoe_clip_qkv_renormalised": Case(_config(
        "olmoe", num_experts=4, num_experts_per_tok=2, intermediate_size=20, clip_qkv=0.8, norm_topk_prob=True,
        attention_bias=True)),
    "minimax_m2_partial_rotary": Case(_config(
        "minimax_m2", num_local_experts=4, num_experts_per_tok=2, intermediate_size=20, head_dim=12,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        edit_config=_as_rotary_dim),
    "glm4_moe_groups_qk_norm": Case(_config(
        "glm4_moe", **GROUPED, n_group=4, topk_group=2, n_shared_experts=1, use_qk_norm=True, attention_bias=True,
        routed_scaling_factor=1.5)),
    "dots1_sliding_unnormalised": Case(_config(
        "dots1", **GROUPED, n_group=2, topk_group=1, n_shared_experts=2, norm_topk_prob=False, sliding_window=5,
        max_window_layers=1)),
    "ernie4_5_moe_interval_biases": Case(_config(
        "ernie4_5_moe", moe_num_experts=4, moe_k=2, moe_intermediate_size=20, moe_num_shared_experts=1,
        moe_layer_start_index=0, moe_layer_interval=2, use_bias=True, head_dim=12)),
    "hunyuan_moe_shared_alpha": Case(_config(
        "hunyuan_v1_moe", num_experts=4, moe_topk=2, intermediate_size=20, head_dim=12, attention_bias=True,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.0, "alpha": 4.0})),
    "phimoe_sparsemixer": Case(_config(
        "phimoe", num_local_experts=4, num_experts_per_tok=2, intermediate_size=20, attention_bias=True,
        lm_head_bias=True, sliding_window=5, router_jitter_noise=0.3)),
    "granitemoe_multipliers": Case(_config("granitemoe", **GRANITE)),
    "granitemoeshared_multipliers": Case(_config("granitemoeshared", **GRANITE, shared_intermediate_size=24)),
}

globals().update(family_parity_tests(CASES))


saved = saved_on_demand(CASES)


# ---- each new config value is really exercised: without it the logits move far past the tolerance ----

FEATURES = {
    "sparsemixer_threshold": ("phimoe_sparsemixer", lambda c: c.update(router_jitter_noise=0.01)),
    "ernie_norm_min": ("ernie4_5_moe_interval_biases", lambda c: c.update(moe_norm_min=10.0)),
    "granite_moe_residual_multiplier": ("granitemoe_multipliers", lambda c: c.update(residual_multiplier=1.0)),
    "olmoe_clip_qkv": ("olmoe_clip_qkv_renormalised", lambda c: c.update(clip_qkv=None)),
    "minimax_rotary_dim": ("minimax_m2_partial_rotary", lambda c: c.update(rotary_dim=12)),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_new_config_value_changes_the_logits(saved, feature, tmp_path):
    case_name, edit = FEATURES[feature]
    case = saved(case_name)
    with torch.no_grad():
        changed = wb.load_model(_copy(case.directory, tmp_path, edit))(case.tokens)
    assert max_diff(changed, case.logits) > 100 * TOLERANCE


def test_config_values_map_as_written(saved):
    phimoe = wb.load_model(saved("phimoe_sparsemixer").directory).cfg
    assert (phimoe.moe.router_scoring, phimoe.moe.router_jitter_eps, phimoe.unembed_bias) == ("sparsemixer", 0.3, True)
    ernie = wb.load_model(saved("ernie4_5_moe_interval_biases").directory).cfg
    assert ernie.moe_layers == [1] and ernie.moe.router_renormalize_floor == 1e-12
    glm = wb.load_model(saved("glm4_moe_groups_qk_norm").directory).cfg
    assert (glm.moe_layers, glm.moe.router_groups, glm.moe.d_shared_expert, glm.rotary_dim) == ([1, 2], 4, 20, 6)
    minimax = wb.load_model(saved("minimax_m2_partial_rotary").directory).cfg
    assert (minimax.rotary_dim, minimax.qk_norm) == (6, "projection")


def test_sparsemixer_routes_as_a_hand_calculation():
    """Logits [2, 1.9, 0, -1] with eps 0.1: round one keeps 1.9 (|2 - 1.9| / 2 <= 0.2) beside the best, round
    two picks expert 1 and keeps only itself (0's and -1's gaps exceed 0.2 * 1.9)."""
    indices, weights = RoutingRule(k=2, scoring="sparsemixer", jitter_eps=0.1).choose(
        torch.tensor([[[2.0, 1.9, 0.0, -1.0]]]))
    first = torch.softmax(torch.tensor([2.0, 1.9]), dim=0)[0]
    assert indices.tolist() == [[[0, 1]]]
    assert torch.allclose(weights, torch.tensor([[[first.item(), 1.0]]]))


@pytest.mark.parametrize("name, changes, field", [
    ("hunyuan_moe_shared_alpha", {"moe_topk": [2, 2, 2]}, "moe_topk"),
    ("glm4_moe_groups_qk_norm", {"n_group": 3}, "n_group"),
    ("ernie4_5_moe_interval_biases", {"moe_layer_interval": 0}, "moe_layer_interval"),
    # transformers 5.24's Phimoe rotary keeps the short factors at every length: not longrope, refused
    ("phimoe_sparsemixer", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 6,
                                                "long_factor": [2.0] * 6, "original_max_position_embeddings": 16}},
     "rope_parameters.rope_type"),
])
def test_router_configs_we_cannot_honour_name_their_field(saved, tmp_path, name, changes, field):
    directory = _copy(saved(name).directory, tmp_path, lambda c: c.update(changes))
    with pytest.raises(ConfigError, match=f"'{field}'"):
        wb.load_model(directory)


def test_jetmoe_is_refused_naming_its_mixture_of_attention_experts(saved, tmp_path):
    """JetMoE's attention routes each token to its own query/output projections: refused by name."""
    directory = _copy(saved("olmoe_clip_qkv_renormalised").directory, tmp_path,
                      lambda c: c.update(architectures=["JetMoeForCausalLM"], model_type="jetmoe"))
    with pytest.raises(CheckpointError, match="JetMoeForCausalLM.*attention is itself a mixture of experts"):
        wb.load_model(directory)


# ---- padded batches: windows, QK norms and routers per row ----

PADDED = ["phimoe_sparsemixer", "dots1_sliding_unnormalised", "hunyuan_moe_shared_alpha", "olmoe_clip_qkv_renormalised"]


@pytest.mark.parametrize("name", PADDED)
def test_padded_logits_equal_transformers_at_every_real_position(saved, name):
    case = saved(name)
    tokens, mask = padded_batch("left")
    ours = wb.load_model(case.directory)
    with torch.no_grad():
        expected = case.hf_model(tokens, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        real = mask.bool()
        for kernel in ("eager", "sdpa", "flash"):
            logits = ours.set_attn_impl(kernel)(tokens, attention_mask=mask)
            assert max_diff(logits[real], expected[real]) < TOLERANCE, (name, kernel)
