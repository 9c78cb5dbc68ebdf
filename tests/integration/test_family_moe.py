"""Mixture-of-experts and latent-attention families load at parity with transformers (``family_parity``):
DeepSeek-V2 (greedy and group-limited softmax routing, with and without the query bottleneck, YaRN
with mscale), DeepSeek-V3 (sigmoid routing with a correction bias and groups, interleaved and
half-split RoPE), Qwen2-MoE (sigmoid-gated shared expert, dense mlp_only_layers, sliding windows),
Qwen3-MoE (decoder_sparse_step, renormalised top-k) and gpt-oss (attention sinks, alternating
windows, clamped SwiGLU experts with biases, biased router).

Beyond the shared parity tests: each layer's router logits, chosen experts and their weights equal
transformers' own router outputs on the same input; experts written fused (transformers' in-memory
layout) load like per-expert ones; config values we cannot honour name their field.

Tiny configs: d_model 48 over 4 heads, vocab 101, 3 layers, 4-8 experts of width 20; every weight and
the correction biases re-drawn (``hf_tiny.randomize``), so no gain is 1 and no bias 0.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import workbench as wb
from tests.integration.family_parity import TOLERANCE, Case, family_parity_tests, max_diff, saved_on_demand
from workbench.errors import ConfigError

TINY = dict(vocab_size=101, hidden_size=48, num_attention_heads=4, num_hidden_layers=3, intermediate_size=80,
            max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=2)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
           moe_intermediate_size=20, num_experts_per_tok=2, first_k_dense_replace=1)
YARN_MSCALE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
               "mscale": 0.707, "mscale_all_dim": 1.0}


def _config(model_type: str, **fields):
    return lambda: AutoConfig.for_model(model_type, **{**TINY, **fields})


CASES = {
    "deepseek_v2_group_limited_yarn": Case(_config(
        "deepseek_v2", **MLA, q_lora_rank=24, n_routed_experts=8, n_shared_experts=2, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=1.5, rope_parameters=YARN_MSCALE)),
    "deepseek_v2_lite_greedy_biases": Case(_config(
        "deepseek_v2", **MLA, q_lora_rank=None, n_routed_experts=4, n_shared_experts=1, attention_bias=True,
        mlp_bias=True, tie_word_embeddings=True)),
    "deepseek_v3": Case(_config(
        "deepseek_v3", **MLA, q_lora_rank=24, n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5)),
    "deepseek_v3_halves_yarn_unnormalised": Case(_config(
        "deepseek_v3", **MLA, q_lora_rank=24, n_routed_experts=8, n_shared_experts=2, n_group=2, topk_group=1,
        norm_topk_prob=False, rope_interleave=False, rope_parameters=YARN_MSCALE, attention_bias=True)),
    "qwen2_moe_shared_sliding": Case(_config(
        "qwen2_moe", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
        shared_expert_intermediate_size=24, mlp_only_layers=[0], use_sliding_window=True, sliding_window=6,
        max_window_layers=2)),
    "qwen3_moe_sparse_step_renormalised": Case(_config(
        "qwen3_moe", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
        head_dim=16, decoder_sparse_step=2, norm_topk_prob=True, attention_bias=True)),
    "gpt_oss": Case(_config(
        "gpt_oss", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, head_dim=12,
        sliding_window=5)),
}

globals().update(family_parity_tests(CASES))


def _transformers_routing(hf_model, tokens: torch.Tensor) -> dict[int, tuple]:
    """Per decoder layer with a router: transformers' own (logits, weights, indices), read off the
    router module's outputs with forward hooks (each router returns all three; the modules named
    ...Router, or HunYuan-MoE's ...Gate, under the layer)."""
    found, handles = {}, []
    for layer, decoder_layer in enumerate(hf_model.model.layers):
        router = next((m for name, m in decoder_layer.named_modules()
                       if type(m).__name__.endswith(("Router", "MoEV1Gate"))), None)  # HunYuan's is a Gate
        if router is not None:
            handles.append(router.register_forward_hook(lambda _m, _i, out, layer=layer: found.__setitem__(layer, out)))
    try:
        with torch.no_grad():
            hf_model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _sorted_by_expert(indices_Nk: torch.Tensor, weights_Nk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = indices_Nk.argsort(dim=-1)
    return indices_Nk.gather(-1, order), weights_Nk.float().gather(-1, order)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_router_choices_match_transformers(family, attn_impl):
    """The same experts with the same weights, token by token, and the same raw logits."""
    model = wb.load_model(family.directory, attn_impl=attn_impl)
    reference = _transformers_routing(family.hf_model, family.tokens)
    assert sorted(reference) == model.cfg.moe_layers, "dense and MoE layers must sit where transformers puts them"
    names = [f"blocks.{l}.mlp.{hook}" for l in reference
             for hook in ("hook_router_logits", "hook_expert_indices", "hook_expert_weights")]
    with torch.no_grad():
        _, cache = model.run_with_cache(family.tokens, names_filter=lambda n: n in names)
    for layer, (logits, weights, indices) in reference.items():
        k = indices.shape[-1]
        ours_logits = cache[f"blocks.{layer}.mlp.hook_router_logits"].reshape(-1, logits.shape[-1])
        assert max_diff(ours_logits, logits) < TOLERANCE, (family.name, layer)
        ours_indices, ours_weights = _sorted_by_expert(cache[f"blocks.{layer}.mlp.hook_expert_indices"].reshape(-1, k),
                                                       cache[f"blocks.{layer}.mlp.hook_expert_weights"].reshape(-1, k))
        their_indices, their_weights = _sorted_by_expert(indices.reshape(-1, k), weights.reshape(-1, k))
        assert torch.equal(ours_indices, their_indices), (family.name, layer)
        assert max_diff(ours_weights, their_weights) < TOLERANCE, (family.name, layer)


def test_the_prompt_exercises_the_routers(family):
    """Parity covers the experts: each MoE layer sends the batch's tokens to most of its experts, and
    every expert id runs in some layer."""
    reference = _transformers_routing(family.hf_model, family.tokens)
    chosen = set()
    for layer, (logits, _, indices) in reference.items():
        used = set(indices.flatten().tolist())
        assert len(used) >= 0.75 * logits.shape[-1], (family.name, layer, used)
        chosen |= used
    assert chosen == set(range(logits.shape[-1])), family.name


saved = saved_on_demand(CASES)


def _fuse_experts(directory: Path) -> None:
    """Rewrites per-expert tensors into transformers' in-memory layout: mlp.experts.gate_up_proj
    [E, 2M, D] (gate rows first) and mlp.experts.down_proj [E, D, M]."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    prefixes = sorted({name.split(".experts.")[0] for name in tensors if ".mlp.experts.0.gate_proj" in name})
    for prefix in prefixes:
        count = len({n for n in tensors if n.startswith(f"{prefix}.experts.") and n.endswith("gate_proj.weight")})
        take = lambda e, proj: tensors.pop(f"{prefix}.experts.{e}.{proj}.weight")  # noqa: E731
        tensors[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([take(e, "gate_proj"), take(e, "up_proj")]) for e in range(count)])
        tensors[f"{prefix}.experts.down_proj"] = torch.stack([take(e, "down_proj") for e in range(count)])
    assert prefixes, "the checkpoint had no per-expert tensors to fuse"
    save_file(tensors, path)


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen2_moe_shared_sliding"])
def test_fused_expert_tensors_load_like_per_expert_ones(saved, name, tmp_path):
    case = saved(name)
    fused = Path(shutil.copytree(case.directory, tmp_path / "fused"))
    _fuse_experts(fused)
    model = wb.load_model(fused, attn_impl="eager")
    with torch.no_grad():
        assert max_diff(model(case.tokens), case.logits) < TOLERANCE


def test_multi_token_prediction_layers_are_left_unread(saved, tmp_path):
    """DeepSeek-V3 checkpoints carry an extra layer after the last (multi-token prediction), which
    transformers skips; so do we. A stray tensor inside a real layer is still an error."""
    case = saved("deepseek_v3")
    directory = Path(shutil.copytree(case.directory, tmp_path / "mtp"))
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(48, 96)
    save_file(tensors, directory / "model.safetensors")
    with torch.no_grad():
        assert max_diff(wb.load_model(directory, attn_impl="eager")(case.tokens), case.logits) < TOLERANCE
    tensors["model.layers.1.mlp.stray.weight"] = torch.zeros(2)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(Exception, match="model.layers.1.mlp.stray.weight"):
        wb.load_model(directory)


def _with_config(source: Path, target: Path, **changes) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("name, changes, field", [
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"topk_group": 5}, "topk_group"),
    ("deepseek_v3", {"n_group": 3}, "n_group"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("deepseek_v2_group_limited_yarn", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2_group_limited_yarn", {"scoring_func": "sigmoid"}, "scoring_func"),
    ("qwen3_moe_sparse_step_renormalised", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_router_configs_we_cannot_honour_name_their_field(saved, tmp_path, name, changes, field):
    directory = _with_config(saved(name).directory, tmp_path / "bad", **changes)
    with pytest.raises(ConfigError, match=f"'{field}'"):
        wb.load_model(directory)
