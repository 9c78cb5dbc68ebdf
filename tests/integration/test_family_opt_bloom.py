"""OPT and BLOOM load at parity with transformers (``family_parity``), and config values we cannot
honour are refused naming the field.

Cases: OPT pre-norm (tied, untied without biases, without elementwise-affine norms, with
``word_embed_proj_dim`` < hidden_size), OPT-350m's post-norm (with and without the projection),
BLOOM with 8 heads, 6 and 12 (non-powers of two: ALiBi's interleaved extra slopes), untied.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import BloomConfig, OPTConfig
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

import workbench as wb
from tests.integration.family_parity import Case, build_and_save, family_parity_tests
from tests.integration.hf_tiny import N_CTX, VOCAB
from workbench.components.rotary import alibi_slopes

_SPECIAL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=2)
_OPT = dict(**_SPECIAL, hidden_size=48, num_attention_heads=6, num_hidden_layers=2, ffn_dim=80,
            max_position_embeddings=N_CTX)
_BLOOM = dict(**_SPECIAL, n_layer=2)


def opt(**changes) -> OPTConfig:
    return OPTConfig(**{**_OPT, **changes})


def bloom(**changes) -> BloomConfig:
    return BloomConfig(**{**_BLOOM, **changes})


CASES = {
    "opt_pre_norm_tied": Case(lambda: opt()),
    "opt_untied_no_bias_3_layers": Case(lambda: opt(tie_word_embeddings=False, enable_bias=False,
                                                    num_hidden_layers=3)),
    "opt_no_elementwise_affine": Case(lambda: opt(layer_norm_elementwise_affine=False)),
    # transformers' last hidden state is then project_out's output [.., word_embed_proj_dim]
    "opt_350m_like_post_norm_projected": Case(lambda: opt(do_layer_norm_before=False, word_embed_proj_dim=32),
                                              compare_last_hidden=False),
    "opt_post_norm": Case(lambda: opt(do_layer_norm_before=False)),
    "opt_pre_norm_projected_untied": Case(lambda: opt(word_embed_proj_dim=24, tie_word_embeddings=False),
                                          compare_last_hidden=False),
    "bloom_8_heads": Case(lambda: bloom(hidden_size=64, n_head=8)),
    "bloom_6_heads": Case(lambda: bloom(hidden_size=48, n_head=6)),
    "bloom_12_heads_untied": Case(lambda: bloom(hidden_size=48, n_head=12, tie_word_embeddings=False,
                                                layer_norm_epsilon=1e-3)),
}

globals().update(family_parity_tests(CASES))


# ---- what the parity cases rest on -------------------------------------------------------------
@pytest.mark.parametrize("n_heads", [1, 2, 6, 8, 12, 16, 20, 112])
def test_alibi_slopes_equal_transformers(n_heads):
    expected = _get_alibi_slopes(n_heads, torch.device("cpu"))
    assert torch.allclose(alibi_slopes(n_heads), expected, rtol=1e-6, atol=0)


def test_opt_config_maps_positions_norms_and_projection(tmp_path):
    build_and_save(opt(do_layer_norm_before=False, word_embed_proj_dim=32), tmp_path)
    model = wb.load_model(tmp_path)
    cfg = model.cfg
    assert (cfg.norm_placement, cfg.has_final_norm, cfg.act_fn, cfg.tie_embeddings) == ("post", False, "relu", False)
    assert model.pos_embed.W_pos.shape == (N_CTX, 48)  # the two offset rows dropped
    assert model.embed.W_E.shape == (VOCAB, 48) and model.unembed.W_U.shape == (48, VOCAB)


def test_bloom_config_maps_alibi_and_embedding_norm(tmp_path):
    build_and_save(bloom(hidden_size=48, n_head=6), tmp_path)
    cfg = wb.load_model(tmp_path).cfg
    assert (cfg.positional, cfg.embed_norm, cfg.act_fn, cfg.d_mlp, cfg.n_ctx) == ("alibi", True, "gelu_new", 192, 2048)


# ---- refusals ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One valid OPT and one valid BLOOM directory, to copy and break."""
    out = {}
    for name, config in (("opt", opt()), ("bloom", bloom(hidden_size=48, n_head=6))):
        out[name] = tmp_path_factory.mktemp(name)
        build_and_save(config, out[name])
    return out


def _broken_copy(source: Path, destination: Path, **changes) -> Path:
    """A copy of ``source`` whose config.json has ``changes`` and whose weights are gone: the
    refusal must come from the config alone, before any tensor is read (nothing half-loaded)."""
    shutil.copytree(source, destination)
    path = destination / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    (destination / "model.safetensors").unlink()
    return destination


@pytest.mark.parametrize("family, field, value", [
    ("bloom", "apply_residual_connection_post_layernorm", True),
    ("opt", "_remove_final_layer_norm", True),
    ("opt", "activation_function", "quick_gelu"),
])
def test_values_we_cannot_honour_are_refused_naming_the_field(saved, tmp_path, family, field, value):
    broken = _broken_copy(saved[family], tmp_path / "broken", **{field: value})
    with pytest.raises(wb.ConfigError, match=rf"config\.json: field '{field}' = .* cannot be honoured"):
        wb.load_model(broken)


def test_the_unbroken_copies_still_load(saved):
    for directory in saved.values():
        model = wb.load_model(directory)
        assert math.isfinite(model(torch.tensor([[3, 4, 5]])).abs().max().item())
