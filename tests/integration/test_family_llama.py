"""The Llama-like family loads at parity with transformers (``family_parity``): Llama under every
RoPE scaling (linear, dynamic, llama3, yarn), each written both as transformers 5's
``rope_parameters`` and as transformers 4's ``rope_scaling`` + ``rope_theta``; Qwen2/2.5 with
sliding windows on some layers and yarn; Qwen3; SmolLM3 with NoPE layers; OLMo (parameter-free
LayerNorm, clip_qkv); OLMo 2 (norms after the sublayers, QK norm over the projection). Config
values these architectures cannot honour are refused by field before any weight is read.

Tiny configs: d_model 48 over 6 heads (2 KV heads: groups of 3), vocab 101, 2-3 layers, windows of
5-6 tokens and original contexts of 8-16 positions (shorter than the 24-token prompt, so windows
mask real keys and the scalings change the frequencies the prompt uses). Dynamic NTK runs with
max_position_embeddings 16, so the 24-token prompt makes transformers refit the base; it accepts
prompts past max_position_embeddings there, and so do we (``ModelConfig.context_limit``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, Olmo2Config, OlmoConfig, Qwen2Config, Qwen3Config,
                          SmolLM3Config)

import workbench as wb
import workbench.loading.hf.loader as hf_loading
from tests.integration.family_parity import (TOLERANCE, Case, build_and_save, family_parity_tests, max_diff,
                                             saved_on_demand)
from workbench.generation import generate_tokens
from workbench.loading.hf.config import HFConfig
from workbench.loading.hf.llama import model_config

TINY = dict(vocab_size=101, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=80, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=2)
THREE = {**TINY, "num_hidden_layers": 3}


def legacy_rope(config: dict, type_key: str = "rope_type") -> dict:
    """transformers 4's spelling of a saved config.json: ``rope_theta`` at the top level and the
    scaling, if any, under ``rope_scaling`` (keyed ``type`` in the oldest files)."""
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    if kind != "default":
        config["rope_scaling"] = {type_key: kind, **params}
    return config


def oldest_rope(config: dict) -> dict:
    return legacy_rope(config, type_key="type")


def without_layer_types(config: dict) -> dict:
    """A Qwen2 config.json as transformers 4 wrote it: use_sliding_window + max_window_layers only."""
    config.pop("layer_types")
    return config


def _llama(rope: dict, **fields) -> LlamaConfig:
    return LlamaConfig(**{**TINY, **fields}, rope_parameters=rope)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
LINEAR = {"rope_type": "linear", "rope_theta": 500.0, "factor": 3.0}
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
YARN_EXPLICIT = {**YARN, "attention_factor": 0.8, "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False}
YARN_MSCALE = {**YARN, "factor": 8.0, "original_max_position_embeddings": 8, "mscale": 0.707, "mscale_all_dim": 1.0}
QWEN_YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 16}

ROPE_CASES = {
    "llama3_rope": Case(lambda: _llama(LLAMA3)),
    "llama3_rope_legacy": Case(lambda: _llama(LLAMA3, tie_word_embeddings=True), edit_config=legacy_rope),
    "linear_rope": Case(lambda: _llama(LINEAR, tie_word_embeddings=True)),
    "linear_rope_legacy_type_key": Case(lambda: _llama(LINEAR), edit_config=oldest_rope),
    # max_position_embeddings 16 < the 24-token prompt: the NTK base is refitted to the call.
    "dynamic_rope": Case(lambda: _llama(DYNAMIC, max_position_embeddings=16)),
    "dynamic_rope_legacy_type_key": Case(lambda: _llama(DYNAMIC, max_position_embeddings=16, tie_word_embeddings=True),
                                         edit_config=oldest_rope),
    "yarn_rope": Case(lambda: _llama(YARN)),
    "yarn_rope_legacy": Case(lambda: _llama(YARN, tie_word_embeddings=True), edit_config=legacy_rope),
    "yarn_rope_attention_factor_betas": Case(lambda: _llama(YARN_EXPLICIT, attention_bias=True, mlp_bias=True)),
    "yarn_rope_mscale_legacy": Case(lambda: _llama(YARN_MSCALE), edit_config=legacy_rope),
}

CASES = {
    **ROPE_CASES,
    # Qwen2.5's long-context shape: yarn, and windows on some layers only (layer_types as saved).
    "qwen25_yarn_sliding_layers": Case(lambda: Qwen2Config(
        **THREE, use_sliding_window=True, sliding_window=5, rope_parameters=QWEN_YARN,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]), edit_config=legacy_rope),
    # transformers 4's spelling: no layer_types, windows from layer max_window_layers=1 on.
    "qwen2_sliding_from_max_window_layers": Case(lambda: Qwen2Config(
        **THREE, use_sliding_window=True, sliding_window=6, max_window_layers=1, tie_word_embeddings=True),
        edit_config=without_layer_types),
    # head_dim 16 != d_model / heads, as Qwen3's is; untied.
    "qwen3_gqa_untied": Case(lambda: Qwen3Config(**THREE, head_dim=16)),
    "qwen3_tied_bias_sliding_layer": Case(lambda: Qwen3Config(
        **THREE, head_dim=8, tie_word_embeddings=True, attention_bias=True, use_sliding_window=True,
        sliding_window=5, layer_types=["full_attention", "sliding_attention", "full_attention"])),
    "smollm3_nope_middle": Case(lambda: SmolLM3Config(**THREE, no_rope_layers=[1, 0, 1])),
    # A window on the NoPE layers (SmolLM3's default rule), untied, biases.
    "smollm3_sliding_nope_untied_bias": Case(lambda: SmolLM3Config(
        **THREE, no_rope_layers=[0, 1, 0], use_sliding_window=True, sliding_window=5, tie_word_embeddings=False,
        attention_bias=True, mlp_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    "olmo": Case(lambda: OlmoConfig(**THREE)),
    "olmo_clip_qkv_bias_tied": Case(lambda: OlmoConfig(**THREE, clip_qkv=0.5, attention_bias=True,
                                                       tie_word_embeddings=True)),
    "olmo2": Case(lambda: Olmo2Config(**THREE)),
    "olmo2_mha_bias_tied": Case(lambda: Olmo2Config(**{**THREE, "num_key_value_heads": 6}, attention_bias=True,
                                                    tie_word_embeddings=True, rms_norm_eps=1e-6)),
}

globals().update(family_parity_tests(CASES))


saved = saved_on_demand(CASES)


def _copy(source: Path, target: Path, edit=None) -> Path:
    shutil.copytree(source, target, dirs_exist_ok=True)
    if edit is not None:
        config = json.loads((target / "config.json").read_text())
        edit(config)
        (target / "config.json").write_text(json.dumps(config))
    return target


# ---- the config spellings and what they mean ----------------------------------------------------

@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.edit_config is not None))
def test_transformers_reads_the_older_spelling_as_the_same_model(saved, name):
    """The rewritten config.json is no private dialect: transformers itself loads it to the logits
    the transformers-5 config gave (so our parity on it is parity with transformers)."""
    case = saved(name)
    reloaded = AutoModelForCausalLM.from_pretrained(case.directory, attn_implementation="eager").eval()
    with torch.no_grad():
        assert max_diff(reloaded(case.tokens).logits, case.logits) < TOLERANCE


@pytest.mark.parametrize("name", sorted(ROPE_CASES) + ["qwen25_yarn_sliding_layers"])
def test_each_rope_scaling_changes_the_prompts_logits(saved, name, tmp_path):
    """Against the same weights with plain RoPE, each scaling moves the logits well past the
    tolerance within the 24-token prompt: the parity above is not parity of unscaled models."""
    case = saved(name)

    def unscale(config):
        spec = config.pop("rope_parameters", None) or {}
        theta = spec.get("rope_theta", config.pop("rope_theta", None))
        config.pop("rope_scaling", None)
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        config["max_position_embeddings"] = 64  # a plain RoPE table ends there; the dynamic case's is 16

    plain = wb.load_model(_copy(case.directory, tmp_path, unscale))
    assert plain.cfg.rotary_scaling is None
    with torch.no_grad():
        assert max_diff(plain(case.tokens), case.logits) > 100 * TOLERANCE


def test_rope_fields_map_as_written(saved):
    cfg = wb.load_model(saved("yarn_rope_mscale_legacy").directory).cfg
    assert cfg.rotary_scaling == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8,
                                  "mscale": 0.707, "mscale_all_dim": 1.0}
    cfg = wb.load_model(saved("dynamic_rope_legacy_type_key").directory).cfg
    assert (cfg.rotary_scaling, cfg.n_ctx, cfg.context_limit) == ({"rope_type": "dynamic", "factor": 2.0}, 16, None)


def test_dynamic_rope_generation_past_max_positions_matches_transformers(saved):
    """Generating from 12 to 20 tokens, past max_position_embeddings 16, with the KV cache: each step
    refits the NTK base to its position as transformers does (keys cached under the older bases),
    and every step's logits and the greedy tokens agree with transformers' cached generation."""
    case = saved("dynamic_rope")
    prompt = case.tokens[:, :12]
    reference = AutoModelForCausalLM.from_pretrained(case.directory, attn_implementation="eager").eval()
    reference.generation_config.eos_token_id = None  # run all 8 steps, as stop_at_eos=False does
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=2,
                                      return_dict_in_generate=True, output_logits=True)
    model = wb.load_model(case.directory)
    tokens, step_logits = generate_tokens(model, prompt, 8, use_kv_cache=True, stop_at_eos=False)
    assert torch.equal(tokens, expected.sequences)
    assert max_diff(step_logits, torch.stack(expected.logits, dim=1)) < TOLERANCE


def test_a_fixed_rope_table_still_ends_at_max_positions(saved):
    model = wb.load_model(saved("yarn_rope").directory)
    with pytest.raises(wb.InputError, match="n_ctx=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_layer_kinds_map_as_transformers_masks_them(saved):
    layers = {name: wb.load_model(saved(name).directory).cfg for name in
              ("qwen25_yarn_sliding_layers", "qwen2_sliding_from_max_window_layers", "smollm3_sliding_nope_untied_bias",
               "qwen3_tied_bias_sliding_layer")}
    assert layers["qwen25_yarn_sliding_layers"].layer_values("sliding_window") == [5, None, 5]
    assert layers["qwen2_sliding_from_max_window_layers"].layer_values("sliding_window") == [None, 6, 6]
    smollm3 = layers["smollm3_sliding_nope_untied_bias"]
    assert smollm3.layer_values("sliding_window") == [5, None, 5]
    assert smollm3.layer_values("positional") == ["none", "rotary", "none"]
    assert layers["qwen3_tied_bias_sliding_layer"].layer_values("sliding_window") == [None, 5, None]


def test_olmo_clip_qkv_clamps_the_projections(saved):
    case = saved("olmo_clip_qkv_bias_tied")
    model = wb.load_model(case.directory)
    assert model.cfg.clip_qkv == 0.5
    with torch.no_grad():
        _, cache = model.run_with_cache(case.tokens, names_filter=lambda n: n.endswith(("hook_q", "hook_k", "hook_v")))
    assert all(t.abs().max().item() == pytest.approx(0.5) for t in cache.values())  # the clamp really binds


@pytest.mark.parametrize("architecture, fields, expected", [
    # Fields a config.json may omit take the architecture's transformers default.
    ("Qwen3ForCausalLM", {}, {"d_head": 128, "n_key_value_heads": 32, "norm_eps": 1e-6, "sliding_window": None}),
    ("SmolLM3ForCausalLM", {}, {"rotary_base": 2000000.0, "tie_embeddings": True, "n_key_value_heads": 4}),
    ("Olmo2ForCausalLM", {}, {"norm_eps": 1e-5, "norm_placement": "sublayer_output", "qk_norm": "projection"}),
    ("OlmoForCausalLM", {"rms_norm_eps": 0.1}, {"norm_eps": 1e-5, "normalization": "LN"}),  # fixed, as OlmoLayerNorm's
    ("MistralForCausalLM", {}, {"sliding_window": 4096, "n_key_value_heads": 8}),
    ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2},
     {"norm_eps": 1e-5, "sliding_window": None}),
])
def test_missing_fields_take_transformers_defaults(architecture, fields, expected):
    data = {"hidden_size": 64, "num_attention_heads": 32, "num_hidden_layers": 4, "intermediate_size": 96,
            "vocab_size": 101, "max_position_embeddings": 64, "hidden_act": "silu", **fields}
    cfg = model_config(HFConfig(data, "config.json"), architecture)
    assert {key: getattr(cfg, key) for key in expected} == expected
    if architecture == "SmolLM3ForCausalLM":  # no_rope_layer_interval 4: every 4th layer without RoPE
        assert cfg.layer_values("positional") == ["rotary", "rotary", "rotary", "none"]


# ---- values we cannot honour: a ConfigError naming the field, raised before any weight is read ----

REFUSALS = {
    "partial_rotary": ("llama3_rope", lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5),
                       "rope_parameters.partial_rotary_factor"),
    "partial_rotary_legacy": ("olmo", lambda c: c.update(partial_rotary_factor=0.5), "partial_rotary_factor"),
    "longrope": ("qwen3_gqa_untied", lambda c: c["rope_parameters"].update(rope_type="longrope", factor=2.0),
                 "rope_parameters.rope_type"),
    "window_on_olmo": ("olmo2", lambda c: c.update(sliding_window=5), "sliding_window"),
    # transformers drops the window without use_sliding_window, then cannot build the sliding mask.
    "qwen_sliding_layer_without_window": ("qwen3_tied_bias_sliding_layer", lambda c: c.update(use_sliding_window=False),
                                          "sliding_window"),
    "nope_layer_count": ("smollm3_nope_middle", lambda c: c.update(no_rope_layers=[1, 0]), "no_rope_layers"),
    "nope_layer_count_with_windows": ("smollm3_sliding_nope_untied_bias",
                                      lambda c: c.update(no_rope_layers=[1, 0], layer_types=None), "no_rope_layers"),
    "layer_types_count": ("qwen3_gqa_untied", lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
    "activation": ("olmo2", lambda c: c.update(hidden_act="mish"), "hidden_act"),
}


@pytest.fixture(scope="module")
def refusal_sources(tmp_path_factory):
    """One saved directory per case a refusal edits (built once, copied per test)."""
    out = {}
    for name in sorted({case for case, _, _ in REFUSALS.values()}):
        out[name] = tmp_path_factory.mktemp(f"refuse_{name}")
        build_and_save(CASES[name].config(), out[name])
    return out


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_unhonourable_config_value_is_refused_by_field_before_reading_weights(refusal, refusal_sources, tmp_path,
                                                                              monkeypatch):
    case, edit, field = REFUSALS[refusal]
    directory = _copy(refusal_sources[case], tmp_path, edit)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were opened before the config was checked")

    monkeypatch.setattr(hf_loading, "SafetensorsCheckpoint", no_weights)
    with pytest.raises(wb.ConfigError, match=rf"config\.json: .*'{field.replace('.', '[.]')}'"):
        wb.load_model(directory)


def test_missing_qk_norm_tensor_is_named_and_nothing_is_returned(refusal_sources, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _copy(refusal_sources["qwen3_gqa_untied"], tmp_path)
    tensors = load_file(directory / "model.safetensors")
    missing = "model.layers.2.self_attn.k_norm.weight"
    del tensors[missing]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(wb.CheckpointError, match=missing.replace(".", r"\.")):
        wb.load_model(directory)
