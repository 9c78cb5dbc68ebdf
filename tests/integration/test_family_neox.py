"""GPT-NeoX / Pythia, GPT-J and GPT-Neo load at parity with transformers (``family_parity``), and
config values they cannot honour are refused by field before any weight is read.

Tiny configs: d_model 48 over 6 heads (d_head 8), vocab 101, 2-3 layers, windows of 5 and 7 tokens
(shorter than the 24-token prompt, so they mask real keys).
"""

from __future__ import annotations

import json

import pytest
from transformers import GPTJConfig, GPTNeoConfig, GPTNeoXConfig

import workbench as wb
import workbench.loading.hf.loader as hf_loading
from tests.integration.family_parity import Case, build_and_save, family_parity_tests

_TOKENS = dict(vocab_size=101, bos_token_id=1, eos_token_id=2)
_NEOX = dict(**_TOKENS, hidden_size=48, num_attention_heads=6, num_hidden_layers=2, intermediate_size=80,
             max_position_embeddings=64)
_GPTJ = dict(**_TOKENS, n_embd=48, n_head=6, n_layer=2, n_positions=64)
_NEO = dict(**_TOKENS, hidden_size=48, num_heads=6, max_position_embeddings=64)

CASES = {
    # Pythia's shape: parallel residual, a quarter of each head rotated, untied embed_out.
    "pythia_parallel_quarter_rotary": Case(lambda: GPTNeoXConfig(**_NEOX, use_parallel_residual=True,
                                                                 rotary_pct=0.25, rotary_emb_base=500)),
    # Sequential block, full rotary, no attention biases, tied embeddings, a tanh GELU.
    "neox_sequential_full_rotary_tied": Case(lambda: GPTNeoXConfig(
        **_NEOX, use_parallel_residual=False, attention_bias=False, tie_word_embeddings=True,
        hidden_act="gelu_new", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 1.0})),
    # Half rotary, three layers, linear RoPE scaling.
    "neox_sequential_half_rotary_linear": Case(lambda: GPTNeoXConfig(
        **{**_NEOX, "num_hidden_layers": 3}, use_parallel_residual=False,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0, "partial_rotary_factor": 0.5})),
    "gptj_partial_rotary": Case(lambda: GPTJConfig(**_GPTJ, rotary_dim=4)),
    "gptj_full_rotary_tied": Case(lambda: GPTJConfig(**_GPTJ, rotary_dim=8, n_inner=80, tie_word_embeddings=True)),
    # TinyStories' pattern: global, local (window 5), tied.
    "neo_global_local_window5": Case(lambda: GPTNeoConfig(**_NEO, num_layers=2, window_size=5,
                                                          attention_types=[[["global", "local"], 1]])),
    # All local, window 7, untied, a given MLP width and the exact GELU.
    "neo_all_local_window7_untied": Case(lambda: GPTNeoConfig(
        **_NEO, num_layers=3, window_size=7, attention_types=[[["local"], 3]], intermediate_size=80,
        tie_word_embeddings=False, activation_function="gelu")),
}

globals().update(family_parity_tests(CASES))


# ---- values we cannot honour: a ConfigError naming the field, raised before any weight is read ----

REFUSALS = {
    "neox_activation": (CASES["pythia_parallel_quarter_rotary"], lambda c: c.update(hidden_act="mish"), "hidden_act"),
    "neox_odd_rotary": (CASES["pythia_parallel_quarter_rotary"],
                        lambda c: c["rope_parameters"].update(partial_rotary_factor=0.375), "partial_rotary_factor"),
    "neox_rope_type": (CASES["pythia_parallel_quarter_rotary"],
                       lambda c: c["rope_parameters"].update(rope_type="longrope", factor=2.0), "rope_type"),
    "gptj_rotary_dim": (CASES["gptj_partial_rotary"], lambda c: c.update(rotary_dim=12), "rotary_dim"),
    "gptj_odd_rotary_dim": (CASES["gptj_partial_rotary"], lambda c: c.update(rotary_dim=3), "rotary_dim"),
    "neo_attention_kind": (CASES["neo_global_local_window5"],
                           lambda c: c.update(attention_types=[[["global", "sparse"], 1]]), "attention_types"),
    "neo_layer_count": (CASES["neo_global_local_window5"],
                        lambda c: c.update(attention_types=[[["global", "local"], 2]]), "attention_types"),
}


@pytest.fixture(scope="module")
def saved_dirs(tmp_path_factory):
    """One saved directory per case that a refusal edits (built once, copied per test)."""
    out = {}
    for name in {"pythia_parallel_quarter_rotary", "gptj_partial_rotary", "neo_global_local_window5"}:
        directory = tmp_path_factory.mktemp(name)
        build_and_save(CASES[name].config(), directory)
        out[name] = directory
    return out


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_unhonourable_config_value_is_refused_by_field_before_reading_weights(refusal, saved_dirs, tmp_path,
                                                                              monkeypatch):
    case, edit, field = REFUSALS[refusal]
    source = saved_dirs[next(name for name, c in CASES.items() if c is case)]
    for path in source.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were opened before the config was checked")

    monkeypatch.setattr(hf_loading, "SafetensorsCheckpoint", no_weights)
    with pytest.raises(wb.ConfigError, match=field):
        wb.load_model(tmp_path)


def test_missing_tensor_is_named_and_nothing_is_returned(saved_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    source = saved_dirs["pythia_parallel_quarter_rotary"]
    for path in source.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    missing = "gpt_neox.layers.1.attention.query_key_value.weight"
    del tensors[missing]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(wb.CheckpointError, match=missing.replace(".", r"\.")):
        wb.load_model(tmp_path)


def test_old_pythia_config_fields_map_like_transformers(saved_dirs, tmp_path):
    """A pre-transformers-5 Pythia config.json (rotary_pct, rotary_emb_base, no rope_parameters)
    gives the same model; without rotary_pct the fraction is transformers' default 0.25."""
    source = saved_dirs["pythia_parallel_quarter_rotary"]
    for path in source.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    new = config.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps({**config, "rotary_emb_base": new["rope_theta"],
                                                      "rotary_pct": new["partial_rotary_factor"]}))
    cfg = wb.load_model(tmp_path).cfg
    assert (cfg.rotary_base, cfg.rotary_dim) == (500.0, 2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert wb.load_model(tmp_path).cfg.rotary_dim == 2  # 0.25 * d_head 8
