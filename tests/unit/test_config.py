import dataclasses

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
    cfg = wb.ModelConfig(**BASE, num_experts=4, experts_per_token=2, layer_overrides=({"sliding_window": 4}, {}))
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


RUNTIME_OPTIONS = ("dtype", "device", "attn_impl", "use_attn_result", "use_split_qkv_input", "use_hook_mlp_in",
                   "weight_processing", "default_prepend_bos", "ungroup_grouped_query_attention")


def test_the_architecture_holds_no_runtime_option():
    fields = {field.name for field in dataclasses.fields(wb.ModelConfig)}
    assert not fields & set(RUNTIME_OPTIONS)
    assert {field.name for field in dataclasses.fields(wb.RuntimeOptions)} == set(RUNTIME_OPTIONS)


@pytest.mark.parametrize("option, value", [("attn_impl", "xformers"), ("dtype", torch.int64), ("use_attn_result", 1),
                                           ("weight_processing", ("fold_ln", "bogus")), ("kernel", "sdpa")])
def test_bad_options_name_the_option(option, value):
    with pytest.raises(ConfigError, match=option):
        wb.RuntimeOptions(**{option: value}) if option != "kernel" else setattr(wb.RuntimeOptions(), option, value)
    options = wb.RuntimeOptions()
    with pytest.raises(ConfigError, match=option):
        setattr(options, option, value)
    assert options == wb.RuntimeOptions()  # a refused assignment leaves the options as they were


def test_one_options_object_is_every_layers_switch():
    model = wb.Decoder(wb.ModelConfig(**BASE), attn_impl="eager", dtype=torch.float64)
    assert model.cfg.attn_impl == "eager" and model.cfg.dtype == torch.float64 and model.W_E.dtype == torch.float64
    model.set_attn_impl("flash")
    model.set_use_attn_result(True)
    assert {block.attn.attn_impl for block in model.blocks} == {"flash"}
    assert all(block.attn.options is model.options and block.options is model.options for block in model.blocks)
    with pytest.raises(AttributeError, match="architecture"):
        model.cfg.n_layers = 3
    model.cfg.attn_impl = "eager"  # TransformerLens's way to set an option: the model's one options object
    assert {block.attn.attn_impl for block in model.blocks} == {"eager"}
    model.to(torch.float32)
    assert model.cfg.dtype == torch.float32 and model.options.device == "cpu"
    twin = wb.Decoder(model.cfg)  # another model's cfg: its architecture and its options
    assert twin.cfg == model.cfg and twin.options is not model.options


def test_split_qkv_input_is_refused_on_a_post_norm_model_and_changes_nothing():
    model = wb.Decoder(wb.ModelConfig(**BASE, norm_placement="post"))
    with pytest.raises(ConfigError, match="use_split_qkv_input needs norm_placement='pre'"):
        model.set_use_split_qkv_input(True)
    assert model.cfg.use_split_qkv_input is False
    with pytest.raises(ConfigError, match="use_split_qkv_input"):
        wb.Decoder(wb.ModelConfig(**BASE, norm_placement="post"), use_split_qkv_input=True)


def test_a_saved_config_written_before_the_split_still_reads():
    from workbench.options import split_saved_config

    old = {**BASE, "attn_impl": "eager", "dtype": "bfloat16", "device": "cpu", "use_attn_result": False,
           "use_split_qkv_input": False, "weight_processing": ["fold_ln"]}
    cfg, options = split_saved_config(old)
    assert cfg == wb.ModelConfig(**BASE)
    assert wb.RuntimeOptions(**options) == wb.RuntimeOptions(attn_impl="eager", dtype=torch.bfloat16,
                                                             weight_processing=("fold_ln",))
