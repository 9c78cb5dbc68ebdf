import pytest
import torch

import workbench as wb
from workbench.errors import ConfigError

BASE = dict(n_layers=2, d_model=64, n_heads=4, d_vocab=100, n_ctx=32)


def test_derived_defaults_resolved_once():
    cfg = wb.ModelConfig(**BASE, n_key_value_heads=2)
    assert (cfg.d_head, cfg.d_mlp, cfg.rotary_dim, cfg.n_query_groups) == (16, 256, 16, 2)
    assert cfg.attn_scale == pytest.approx(4.0)  # TransformerLens: scores are q.k / attn_scale = q.k / sqrt(d_head)


def test_round_trip_through_dict():
    cfg = wb.ModelConfig(**BASE, num_experts=4, experts_per_token=2, dtype=torch.bfloat16)
    assert wb.ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_explicit_d_head_may_differ_from_d_model_over_heads():
    assert wb.ModelConfig(**{**BASE, "d_model": 60}, d_head=16).d_head == 16


@pytest.mark.parametrize("changes, field", [
    (dict(n_key_value_heads=3), "n_key_value_heads"),
    (dict(d_model=62), "d_head"),
    (dict(rotary_dim=18), "rotary_dim"),
    (dict(rotary_dim=3), "rotary_dim"),
    (dict(num_experts=4, experts_per_token=5), "experts_per_token"),
    (dict(experts_per_token=2), "experts_per_token"),
    (dict(normalization="BatchNorm"), "normalization"),
    (dict(positional="relative"), "positional"),
    (dict(act_fn="swish"), "act_fn"),
    (dict(attn_impl="xformers"), "attn_impl"),
    (dict(norm_placement="peri"), "norm_placement"),
    (dict(qk_norm="global"), "qk_norm"),
    (dict(rotary_scaling={"rope_type": "longrope", "factor": 2.0}), "rotary_scaling"),
    (dict(rotary_scaling={"rope_type": "llama3", "factor": 8.0}), "rotary_scaling"),
    (dict(layer_overrides=({"d_model": 8}, {})), "layer_overrides"),
    (dict(layer_overrides=({},)), "layer_overrides"),
    (dict(parallel_attn_mlp=True, norm_placement="post"), "parallel_attn_mlp"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(n_layers=0), "n_layers"),
    (dict(attn_only=True, num_experts=2, experts_per_token=1), "num_experts"),
])
def test_bad_values_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=rf"ModelConfig\.{field}\b"):
        wb.ModelConfig(**{**BASE, **changes})


def test_config_is_frozen():
    cfg = wb.ModelConfig(**BASE)
    with pytest.raises(Exception):
        cfg.n_layers = 3


def test_unknown_field_in_dict_is_named():
    with pytest.raises(ConfigError, match="bogus"):
        wb.ModelConfig.from_dict({**BASE, "bogus": 1})
