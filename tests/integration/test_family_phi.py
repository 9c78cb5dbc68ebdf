"""Phi-1/1.5/2, Phi-3 and StableLM load at parity with `transformers` (``family_parity`` harness),
and config values they cannot honour are refused by name before anything is built.

Variants: Phi with partial rotary 0.5 and 0.4 (d_head 10 -> 4 rotary dims), tied and untied, with
the shared QK LayerNorm and GQA, with linearly scaled RoPE; Phi-3 MHA and GQA, tied, a sliding window of 5 (< the 24-token
prompt), partial rotary; StableLM sequential with per-head QK LayerNorm and q/k/v bias, and with
the parallel residual. Besides: older config.json spellings of the RoPE fields (and the family
defaults of ``partial_rotary_factor`` when absent) read as transformers reads them, and values we
cannot honour (Phi-3's longrope, an odd rotary dimension, ...) raise a ``ConfigError`` naming the
field before any model is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Phi3Config, PhiConfig, StableLmConfig

import workbench as wb
import workbench.loading.build as build
from tests.integration.family_parity import SEQ_LEN, TOLERANCE, Case, build_and_save, family_parity_tests
from tests.integration.hf_tiny import N_CTX, SLIDING_WINDOW, VOCAB

# The word tokenizer's BOS/EOS (Phi-3's defaults, 32000, lie outside the 101-word vocabulary).
TINY = dict(vocab_size=VOCAB, max_position_embeddings=N_CTX, num_hidden_layers=2, intermediate_size=80,
            bos_token_id=1, eos_token_id=2, pad_token_id=2)
SIX_HEADS = dict(TINY, hidden_size=48, num_attention_heads=6)  # d_head 8

# Phi-3's longrope over d_head 8 (four frequencies): a divisor per frequency in each regime.
LONGROPE_FACTORS = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 1.7, 2.2],
                    "long_factor": [2.0, 3.0, 5.0, 9.0]}

CASES = {
    "phi_partial_half": Case(lambda: PhiConfig(**SIX_HEADS, partial_rotary_factor=0.5)),
    "phi_partial_0.4_tied": Case(lambda: PhiConfig(**TINY, hidden_size=40, num_attention_heads=4,
                                                   partial_rotary_factor=0.4, tie_word_embeddings=True)),
    "phi_qk_layernorm_gqa": Case(lambda: PhiConfig(**SIX_HEADS, num_key_value_heads=2, qk_layernorm=True)),
    "phi_rope_linear_gelu": Case(lambda: PhiConfig(**SIX_HEADS, hidden_act="gelu", rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 500.0, "partial_rotary_factor": 0.5})),
    "phi3_mha": Case(lambda: Phi3Config(**SIX_HEADS)),
    "phi3_gqa_tied": Case(lambda: Phi3Config(**SIX_HEADS, num_key_value_heads=2, tie_word_embeddings=True)),
    "phi3_sliding_window": Case(lambda: Phi3Config(**SIX_HEADS, num_key_value_heads=3, sliding_window=SLIDING_WINDOW)),
    "phi3_partial": Case(lambda: Phi3Config(**SIX_HEADS, num_key_value_heads=2, partial_rotary_factor=0.5)),
    # longrope (the 128k checkpoints): the 24-token prompt within the original context (short factors) and past it
    # (long factors; generation from 12 tokens crosses it)
    "phi3_longrope_short": Case(lambda: Phi3Config(**SIX_HEADS, num_key_value_heads=2, original_max_position_embeddings=32,
                                                   rope_parameters=LONGROPE_FACTORS)),
    "phi3_longrope_long": Case(lambda: Phi3Config(**SIX_HEADS, num_key_value_heads=2, original_max_position_embeddings=16,
                                                  rope_parameters=LONGROPE_FACTORS)),
    "stablelm_qk_norm_qkv_bias": Case(lambda: StableLmConfig(**TINY, hidden_size=64, num_attention_heads=4,
                                                             num_key_value_heads=2, use_qkv_bias=True,
                                                             qk_layernorm=True)),
    "stablelm_parallel_tied": Case(lambda: StableLmConfig(**SIX_HEADS, num_key_value_heads=2, qk_layernorm=True,
                                                          use_parallel_residual=True, partial_rotary_factor=0.5,
                                                          tie_word_embeddings=True)),
}

globals().update(family_parity_tests(CASES))


def test_config_mapping(tmp_path):
    """The family's defaults and switches become the ModelConfig values they stand for."""
    expected = {
        "phi_partial_0.4_tied": dict(d_head=10, rotary_dim=4, parallel_attn_mlp=True, unembed_bias=True,
                                     tie_embeddings=True, act_fn="gelu_new", normalization="LN"),
        "phi_qk_layernorm_gqa": dict(n_key_value_heads=2, qk_norm="head", rotary_dim=4),
        "phi3_sliding_window": dict(sliding_window=SLIDING_WINDOW, gated_mlp=True, normalization="RMS",
                                    attn_bias=False, rotary_dim=8),
        "stablelm_qk_norm_qkv_bias": dict(d_head=16, rotary_dim=4, attn_bias=True, parallel_attn_mlp=False),
        "stablelm_parallel_tied": dict(parallel_attn_mlp=True, tie_embeddings=True, rotary_dim=4),
    }
    for name, fields in expected.items():
        build_and_save(CASES[name].config(), tmp_path / name)
        cfg = wb.load_model(tmp_path / name).cfg
        assert {field: getattr(cfg, field) for field in fields} == fields, name


def test_single_parallel_norm_is_two_independent_copies(tmp_path):
    """Phi's one input_layernorm feeds both branches as ln1 and ln2: equal, but not one tensor."""
    build_and_save(CASES["phi_partial_half"].config(), tmp_path)
    block = wb.load_model(tmp_path).blocks[0]
    assert torch.equal(block.ln1.w, block.ln2.w) and torch.equal(block.ln1.b, block.ln2.b)
    assert block.ln1.w.data_ptr() != block.ln2.w.data_ptr()


def _edited_copy(source: Path, destination: Path, **changes) -> Path:
    """A copy of a saved checkpoint whose config.json has ``changes`` (None deletes a key)."""
    destination.mkdir()
    for path in source.iterdir():
        (destination / path.name).write_bytes(path.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not None}
    (destination / "config.json").write_text(json.dumps(config))
    return destination


LEGACY_ROPE = {  # config.json as older transformers wrote it: RoPE fields at the top level, or absent
    "phi_partial_half": {"rope_parameters": None},  # Phi's default partial_rotary_factor, 0.5
    "stablelm_qk_norm_qkv_bias": {"rope_parameters": None},  # StableLM's, 0.25
    "phi_partial_0.4_tied": {"rope_parameters": None, "partial_rotary_factor": 0.4, "rope_theta": 500.0},
    "phi3_partial": {"rope_parameters": None, "partial_rotary_factor": 0.5, "rope_theta": 500.0},
    # Phi-3's older spellings of longrope: rope_scaling with type "su" (or "yarn"), read as longrope
    "phi3_longrope_long": {"rope_parameters": None, "rope_scaling": {
        **{k: v for k, v in LONGROPE_FACTORS.items() if k != "rope_type"}, "type": "su",
        "original_max_position_embeddings": 16}},
    "phi3_longrope_short": {"rope_parameters": None, "rope_scaling": {**LONGROPE_FACTORS, "rope_type": "yarn"}},
}


@pytest.mark.parametrize("name", sorted(LEGACY_ROPE))
def test_legacy_rope_fields_read_as_transformers_reads_them(name, tmp_path):
    build_and_save(CASES[name].config(), tmp_path / "saved")
    directory = _edited_copy(tmp_path / "saved", tmp_path / "legacy", **LEGACY_ROPE[name])
    reference = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (wb.load_model(directory)(tokens) - reference(tokens).logits).abs().max() < TOLERANCE


# ---- values we cannot honour: a ConfigError naming the field, and no model built ------------------

@pytest.fixture(scope="module")
def saved_dirs(tmp_path_factory) -> dict[str, Path]:
    """One small saved checkpoint per architecture, for the error tests to edit copies of."""
    out = {}
    for name in ("phi_qk_layernorm_gqa", "phi3_mha", "stablelm_parallel_tied"):
        out[name] = tmp_path_factory.mktemp(name)
        build_and_save(CASES[name].config(), out[name])
    return out


@pytest.fixture
def no_model_built(monkeypatch):
    """Fails the test if the loader gets as far as building a Decoder (nothing may be half-loaded)."""
    built = []
    real = build.Decoder  # every loader builds its model there
    monkeypatch.setattr(build, "Decoder", lambda *a, **k: built.append(1) or real(*a, **k))
    yield built
    assert not built, "a model was built before the error"


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "original_max_position_embeddings": 32}

REFUSED = {
    "phi3_dynamic_rope": ("phi3_mha", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
                          "rope_parameters.rope_type"),
    "phi3_longrope_factor_count": ("phi3_mha", {"rope_parameters": {**LONGROPE, "short_factor": [1.0] * 3}},
                                   "rope_parameters.short_factor"),
    "phi_odd_rotary_dim": ("phi_qk_layernorm_gqa",
                           {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                                                "partial_rotary_factor": 0.375}}, "partial_rotary_factor"),
    "stablelm_sliding_window": ("stablelm_parallel_tied", {"sliding_window": 4}, "sliding_window"),
    "stablelm_head_dim": ("stablelm_parallel_tied", {"head_dim": 16}, "head_dim"),
    "phi_activation": ("phi_qk_layernorm_gqa", {"hidden_act": "gelu_10"}, "hidden_act"),
}


@pytest.mark.parametrize("refused", sorted(REFUSED))
def test_value_we_cannot_honour_is_refused_by_field(refused, saved_dirs, tmp_path, no_model_built):
    case, changes, field = REFUSED[refused]
    directory = _edited_copy(saved_dirs[case], tmp_path / refused, **changes)
    with pytest.raises(wb.ConfigError, match=f"field '{field}'"):
        wb.load_model(directory)


def test_qk_norm_switched_off_leaves_its_tensors_unexpected(saved_dirs, tmp_path, no_model_built):
    """A config that disagrees with its tensors is a CheckpointError naming a tensor, not a silent drop."""
    directory = _edited_copy(saved_dirs["phi_qk_layernorm_gqa"], tmp_path / "no_qk", qk_layernorm=False)
    with pytest.raises(wb.CheckpointError, match=r"unexpected tensor.*q_layernorm"):
        wb.load_model(directory)


def test_missing_fused_tensor_is_named(saved_dirs, tmp_path, no_model_built):
    directory = _edited_copy(saved_dirs["phi3_mha"], tmp_path / "no_qkv")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.self_attn.qkv_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(wb.CheckpointError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        wb.load_model(directory)


def test_longrope_switches_regime_past_the_original_context(tmp_path):
    """One longrope checkpoint (original context 16): a 16-token call rotates with the short factors and a
    24-token call with the long ones, so the first 16 positions differ between the two calls, as in
    transformers; each call equals transformers' own."""
    hf_model = build_and_save(CASES["phi3_longrope_long"].config(), tmp_path)
    ours = wb.load_model(tmp_path)
    tokens = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        short, long = ours(tokens[:, :16]), ours(tokens)
        assert (short - hf_model(tokens[:, :16]).logits).abs().max() < TOLERANCE
        assert (long - hf_model(tokens).logits).abs().max() < TOLERANCE
    assert (short - long[:, :16]).abs().max() > 100 * TOLERANCE
    scaling = ours.cfg.rotary_scaling
    assert (scaling["rope_type"], scaling["factor"], scaling["original_max_position_embeddings"]) == ("longrope", 4.0, 16)
    assert ours.cfg.rotary_regime_length == 16
