"""Gemma, Gemma 2 and Gemma 3 (text) load at parity with transformers, and refuse what they cannot honour.

The shared parity tests (``family_parity``) run on every case below. The cases cover multi-head,
grouped- and multi-query attention, tied and untied embeddings, attention biases, d_head * n_heads
!= d_model, query_pre_attn_scalar != head_dim, soft-capped scores (Gemma 2) and logits,
sliding windows (5 and 3) shorter than the 24-token prompt in several layer patterns, and Gemma 3's
per-layer-type RoPE (different local and global bases, linear and yarn scaling on global layers).
Gemma 3's ``attn_logit_softcapping`` is set in one case: transformers never applies it, so parity
shows we do not either. (Partial rotary does not exist in Gemma: transformers rotates whole heads.)

Further tests rewrite a saved config.json the way older or hand-written configs read (Gemma 3's
``rope_theta``/``rope_local_base_freq``/``rope_scaling``/``sliding_window_pattern``, Gemma's legacy
``hidden_act: gelu``, fields left out) and compare with transformers loading that same directory;
and check that refused values raise ``wb.ConfigError`` naming the field before any tensor is read.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GemmaConfig

import workbench as wb
import workbench.loading.hf.loader as hf_loading
import workbench.loading.build as build
from tests.integration.family_parity import TOLERANCE, Case, build_and_save, family_parity_tests, max_diff

TINY = dict(vocab_size=101, hidden_size=48, num_attention_heads=6, num_hidden_layers=2, intermediate_size=80,
            max_position_embeddings=64, head_dim=8)
THREE_LAYERS = {**TINY, "num_hidden_layers": 3}
WINDOW = 5  # shorter than the 24-token prompt, so windows mask real keys
SLIDING, FULL = "sliding_attention", "full_attention"
Edit = Callable[[dict[str, Any]], dict[str, Any]]  # a config.json's dict -> the rewritten one


def _older_gemma3_rope(pattern: int | None) -> Edit:
    """The RoPE and layer fields as Gemma 3 configs on the Hub wrote them before rope_parameters:
    the base of local layers, then that of global ones and their scaling; layer kinds by pattern."""
    def edit(config: dict[str, Any]) -> dict[str, Any]:
        dropped = ("rope_parameters", "layer_types", "_sliding_window_pattern", "sliding_window_pattern")
        config = {key: value for key, value in config.items() if key not in dropped}
        config.update(rope_local_base_freq=100.0, rope_theta=5000.0,
                      rope_scaling={"rope_type": "linear", "factor": 4.0})
        return config if pattern is None else {**config, "sliding_window_pattern": pattern}
    return edit


CASES = {
    "gemma_mha": Case(lambda: GemmaConfig(**TINY, num_key_value_heads=6)),
    "gemma_gqa_untied_biased_linear_rope": Case(lambda: GemmaConfig(
        **{**TINY, "head_dim": 12}, num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})),
    # transformers' own layer_types: sliding, full, sliding.
    "gemma2_softcaps_window5": Case(lambda: Gemma2Config(
        **THREE_LAYERS, num_key_value_heads=2, sliding_window=WINDOW, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, query_pre_attn_scalar=24)),
    "gemma2_untied_mha_full_then_window3_uncapped": Case(lambda: Gemma2Config(
        **TINY, num_key_value_heads=6, tie_word_embeddings=False, layer_types=[FULL, SLIDING], sliding_window=3,
        attn_logit_softcapping=None, final_logit_softcapping=None, query_pre_attn_scalar=8)),
    "gemma3_window5_local_global_rope_linear": Case(lambda: Gemma3TextConfig(
        **THREE_LAYERS, num_key_value_heads=2, sliding_window=WINDOW, layer_types=[SLIDING, FULL, SLIDING],
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                         FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}},
        query_pre_attn_scalar=32, final_logit_softcapping=4.0, attn_logit_softcapping=1.0)),
    "gemma3_untied_mqa_window3_rope_yarn": Case(lambda: Gemma3TextConfig(
        **{**TINY, "head_dim": 16, "num_attention_heads": 4}, num_key_value_heads=1, tie_word_embeddings=False,
        layer_types=[FULL, SLIDING], sliding_window=3, query_pre_attn_scalar=20,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10.0},
                         FULL: {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                                "rope_theta": 10000.0}})),
    # The spelling Gemma 3 configs on the Hub used before rope_parameters (transformers reads it the
    # same way: test_rewritten_configs_load_as_transformers_reads_them loads transformers from it).
    "gemma3_older_rope_fields": Case(lambda: CASES["gemma3_window5_local_global_rope_linear"].config(),
                                     edit_config=_older_gemma3_rope(2)),
}

globals().update(family_parity_tests(CASES))

# One saved model per generation, whose config.json the tests below rewrite.
BASES = {"gemma": "gemma_mha", "gemma2": "gemma2_softcaps_window5", "gemma3": "gemma3_window5_local_global_rope_linear"}
TOKENS = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """{generation: a directory transformers saved a random model of that generation to}."""
    out = {}
    for generation, case in BASES.items():
        out[generation] = tmp_path_factory.mktemp(generation)
        build_and_save(CASES[case].config(), out[generation])
    return out


def rewritten(source: Path, target: Path, edit: Edit) -> Path:
    """A copy of the checkpoint in ``source`` with its config.json rewritten by ``edit``."""
    shutil.copytree(source, target, dirs_exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(edit(config)))
    return target


def _drop(*keys: str) -> Edit:
    return lambda config: {key: value for key, value in config.items() if key not in keys}


def _set(**values: Any) -> Edit:
    return lambda config: {**config, **values}


def _longrope_on_global_layers(config: dict[str, Any]) -> dict[str, Any]:
    rope = config["rope_parameters"]
    return {**config, "rope_parameters": {**rope, FULL: {**rope[FULL], "rope_type": "longrope"}}}


# (generation, edit): configs transformers reads in its own way; we must read them the same.
READ_AS_TRANSFORMERS_DOES = {
    "gemma3_older_rope_fields_pattern_2": ("gemma3", _older_gemma3_rope(2)),  # sliding, full, sliding
    "gemma3_older_rope_fields_default_pattern": ("gemma3", _older_gemma3_rope(None)),  # all sliding (every 6th full)
    # transformers merges rope_scaling into {"rope_type": "default"}: spelled with "type", it scales nothing.
    "gemma3_older_rope_scaling_spelled_type": ("gemma3", lambda config: {
        **_older_gemma3_rope(2)(config), "rope_scaling": {"type": "linear", "factor": 4.0}}),
    "gemma_legacy_gelu_is_tanh": ("gemma", _set(hidden_act="gelu")),
    "gemma2_gelu_is_exact": ("gemma2", _set(hidden_activation="gelu")),
    "gemma2_absent_fields_take_its_defaults": ("gemma2", _drop("attn_logit_softcapping", "final_logit_softcapping",
                                                               "query_pre_attn_scalar", "layer_types")),
    "gemma_partial_rotary_ignored_unscaled": ("gemma", _set(partial_rotary_factor=0.5)),
}


@pytest.mark.parametrize("name", sorted(READ_AS_TRANSFORMERS_DOES))
def test_rewritten_configs_load_as_transformers_reads_them(saved, tmp_path, name):
    generation, edit = READ_AS_TRANSFORMERS_DOES[name]
    directory = rewritten(saved[generation], tmp_path, edit)
    reference = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(TOKENS).logits
    if name.startswith("gemma3_older_rope_fields"):  # the older spelling means what the saved one does
        assert AutoConfig.from_pretrained(directory).rope_parameters == AutoConfig.from_pretrained(
            saved[generation]).rope_parameters
    for attn_impl in ("eager", "sdpa"):
        model = wb.load_model(directory, attn_impl=attn_impl)
        with torch.no_grad():
            assert max_diff(model(TOKENS), expected) < TOLERANCE, (name, attn_impl)


def test_older_gemma3_fields_mean_what_the_saved_ones_do(saved, tmp_path):
    """Pattern 2 and rope_scaling on global layers only: the very model transformers saved."""
    directory = rewritten(saved["gemma3"], tmp_path, _older_gemma3_rope(2))
    ours, theirs = wb.load_model(directory), wb.load_model(saved["gemma3"])
    assert ours.cfg == theirs.cfg.replace(model_name=ours.cfg.model_name)
    assert ours.cfg.layer_values("sliding_window") == [WINDOW, None, WINDOW]
    assert ours.cfg.layer_values("rotary_base") == [100.0, 5000.0, 100.0]
    assert ours.cfg.layer_values("rotary_scaling") == [None, {"rope_type": "linear", "factor": 4.0}, None]


def test_gemma3_qk_norm_gains_are_one_plus_the_shared_weight(saved):
    model = wb.load_model(saved["gemma3"])
    hf_weights = load_file(saved["gemma3"] / "model.safetensors")
    q_gain = hf_weights["model.layers.0.self_attn.q_norm.weight"]
    expected = (1 + q_gain).expand(model.cfg.n_heads, -1)
    assert torch.equal(model.blocks[0].attn.q_norm.w.detach(), expected)
    assert model.blocks[0].attn.k_norm.w.shape == (model.cfg.n_key_value_heads, model.cfg.d_head)


# (generation, edit, the field the error must name)
REFUSED = {
    "bidirectional": ("gemma3", _set(use_bidirectional_attention=True), "use_bidirectional_attention"),
    "longrope_on_global_layers": ("gemma3", _longrope_on_global_layers, "rope_parameters.full_attention.rope_type"),
    "unknown_activation": ("gemma2", _set(hidden_activation="tanh"), "hidden_activation"),
    "zero_logit_soft_cap": ("gemma2", _set(final_logit_softcapping=0), "final_logit_softcapping"),
    "unknown_layer_type": ("gemma2", _set(layer_types=[SLIDING, "chunked_attention", FULL]), "layer_types"),
    "partial_rotary_with_scaling": ("gemma", _set(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
                                    "partial_rotary_factor"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_values_name_the_field_before_anything_is_read(saved, tmp_path, monkeypatch, name):
    generation, edit, field = REFUSED[name]
    directory = rewritten(saved[generation], tmp_path, edit)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a refused config must fail before tensors are read or a model is built")

    monkeypatch.setattr(hf_loading, "SafetensorsCheckpoint", must_not_run)
    monkeypatch.setattr(build, "Decoder", must_not_run)  # every loader builds its model there
    with pytest.raises(wb.ConfigError, match=rf"'{re.escape(field)}'.*cannot be honoured"):
        wb.load_model(directory)


def test_missing_qk_norm_tensor_is_named(saved, tmp_path):
    directory = rewritten(saved["gemma3"], tmp_path, lambda config: config)
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(wb.CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        wb.load_model(directory)


def test_multimodal_gemma3_stays_refused(saved, tmp_path):
    directory = rewritten(saved["gemma3"], tmp_path,
                          _set(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3"))
    with pytest.raises(wb.CheckpointError, match=r"unknown architecture.*Gemma3ForConditionalGeneration.*"
                                                 r"supported:.*Gemma3ForCausalLM"):
        wb.load_model(directory)
    listed = set(wb.supported_architectures().architecture)
    assert {"GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"} <= listed
    assert "Gemma3ForConditionalGeneration" not in listed
