"""TransformerLens's names on our models (absent biases as zeros, TL-named parameters, the bridge's
``hook_in``/``hook_out`` block hooks, every ``utils.get_act_name`` name, "did you mean" by meaning).

Expected names come from TransformerLens itself (``transformer_lens.utilities.get_act_name``); values from the
hand calculation (zeros, the stored weights they are views of). Parity with TransformerBridge on the same weights
is in tests/integration/test_tl_demos.py.
"""

from __future__ import annotations

import pytest
import torch
from transformer_lens import utilities as utils

import workbench as wb
from tests.unit.helpers import make_model

TOKENS = torch.tensor([[1, 5, 9, 3, 7, 2]])


# ---- absent biases read as zeros of TransformerLens's shape -------------------------------------------------
@pytest.mark.parametrize("variant", ["gqa_rotary_rms_swiglu", "attn_only_tied", "mha_learned_ln"])
def test_absent_biases_are_zeros_of_transformer_lens_shape(variant):
    model = make_model(variant)
    cfg = model.cfg
    assert model.unembed.stored_bias("b_U") is None
    shapes = {"b_Q": (cfg.n_heads, cfg.d_head), "b_K": (cfg.n_heads, cfg.d_head), "b_V": (cfg.n_heads, cfg.d_head),
              "b_O": (cfg.d_model,)}
    for block in model.blocks:
        for name, shape in shapes.items():
            bias = getattr(block.attn, name)
            assert bias.shape == shape and not bias.any(), name
        if block.has_mlp:
            assert block.mlp.b_in.shape == (cfg.d_mlp,) and block.mlp.b_out.shape == (cfg.d_model,)
            assert not block.mlp.b_in.any() and not block.mlp.b_out.any()
    b_U = model.unembed.b_U
    assert b_U.shape == (cfg.d_vocab,) and b_U.dtype == model.W_U.dtype and not b_U.any()
    values, indices = model.unembed.b_U.sort(descending=True)  # Main_Demo's cell, which failed on None
    assert values.shape == (cfg.d_vocab,)
    # No parameter appears (nothing saved, nothing added in the forward pass).
    assert not any(name.endswith(("b_U", "b_O", "b_in", "b_out")) for name, _ in model.named_parameters())


def test_present_biases_are_the_stored_parameters():
    model = make_model("alibi_gelu_new")  # attn_bias and mlp_bias
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert attn.b_O is attn.stored_bias("b_O") and mlp.b_in is mlp.stored_bias("b_in")
    assert torch.equal(attn.b_Q.flatten(), attn._b_Q_lin)
    with torch.no_grad():
        attn.b_Q[1, 2] = 5.0  # a view: writes the weight
    assert attn._b_Q_lin[1 * model.cfg.d_head + 2].item() == 5.0


def test_a_new_bias_parameter_replaces_the_zeros_and_is_used():
    model = make_model("gqa_rotary_rms_swiglu")
    before = model(TOKENS)
    model.unembed.b_U = torch.nn.Parameter(torch.arange(model.cfg.d_vocab, dtype=torch.float32))
    assert "unembed.b_U" in dict(model.named_parameters())
    torch.testing.assert_close(model(TOKENS), before + torch.arange(model.cfg.d_vocab, dtype=torch.float32))


# ---- TransformerLens-named parameters ---------------------------------------------------------------------
def test_tl_named_parameters_names_shapes_and_views():
    model = make_model("gqa_rotary_rms_swiglu")
    cfg = model.cfg
    H, K, D, M, V = cfg.n_heads, cfg.d_head, cfg.d_model, cfg.d_mlp, cfg.d_vocab
    expected = {"embed.W_E": (V, D)}
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        expected.update({f"{p}.attn.W_Q": (H, D, K), f"{p}.attn.W_K": (H, D, K), f"{p}.attn.W_V": (H, D, K),
                         f"{p}.attn.W_O": (H, K, D), f"{p}.attn.b_Q": (H, K), f"{p}.attn.b_K": (H, K),
                         f"{p}.attn.b_V": (H, K), f"{p}.attn.b_O": (D,), f"{p}.mlp.W_in": (D, M),
                         f"{p}.mlp.W_out": (M, D), f"{p}.mlp.b_in": (M,), f"{p}.mlp.b_out": (D,),
                         f"{p}.mlp.W_gate": (D, M), f"{p}.ln1.w": (D,), f"{p}.ln2.w": (D,)})
    expected.update({"ln_final.w": (D,), "unembed.W_U": (D, V), "unembed.b_U": (V,)})
    named = [(name, tuple(tensor.shape)) for name, tensor in model.tl_named_parameters()]
    assert named == list(expected.items())
    params = model.tl_parameters()
    # Views of the storage, per query head for GQA keys (head h reads key head h // group).
    group = H // cfg.n_key_value_heads
    W_K_lin = model.blocks[1].attn._W_K_lin.view(cfg.n_key_value_heads, K, D)
    for head in range(H):
        torch.testing.assert_close(params["blocks.1.attn.W_K"][head], W_K_lin[head // group].T, rtol=0, atol=0)
    assert params["blocks.0.attn.W_Q"].data_ptr() == model.blocks[0].attn._W_Q_lin.data_ptr()
    state = model.tl_state_dict()
    assert list(state) == list(expected) and not any(t.requires_grad for t in state.values())


def test_tl_parameters_of_a_layernorm_model_with_learned_positions():
    model = make_model("mha_learned_ln")
    names = list(model.tl_parameters())
    assert names[:2] == ["embed.W_E", "pos_embed.W_pos"]
    assert {"blocks.0.ln1.b", "blocks.0.ln2.b", "ln_final.b"} <= set(names)
    assert "blocks.0.mlp.W_gate" not in names


# ---- hook_in / hook_out and every get_act_name name ---------------------------------------------------------
def test_hook_in_and_out_are_resid_pre_and_post_under_a_second_name():
    model = make_model("gqa_rotary_rms_swiglu", attn_impl="eager")
    assert utils.get_act_name("in", 1) == "blocks.1.hook_in" and utils.get_act_name("out", 0) == "blocks.0.hook_out"
    _, full = model.run_with_cache(TOKENS)
    assert "blocks.1.hook_in" not in full  # caching everything stores each point once
    _, asked = model.run_with_cache(TOKENS, names_filter=["blocks.1.hook_in", "blocks.0.hook_out"])
    assert sorted(asked.keys()) == ["blocks.0.hook_out", "blocks.1.hook_in"]
    torch.testing.assert_close(asked["blocks.1.hook_in"], full["blocks.1.hook_resid_pre"], rtol=0, atol=0)
    torch.testing.assert_close(asked["blocks.0.hook_out"], full["blocks.0.hook_resid_post"], rtol=0, atol=0)
    _, both = model.run_with_cache(TOKENS, names_filter=["blocks.1.hook_in", "blocks.1.hook_resid_pre"])
    assert set(both.keys()) == {"blocks.1.hook_in", "blocks.1.hook_resid_pre"}

    # A hook on the alias edits the one point: zeroing the stream entering layer 1 = zeroing resid_pre.
    zero = lambda x, hook: torch.zeros_like(x)  # noqa: E731
    via_alias = model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.hook_in", zero)])
    via_name = model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.hook_resid_pre", zero)])
    torch.testing.assert_close(via_alias, via_name, rtol=0, atol=0)
    assert model.layer_of("blocks.1.hook_out") == 1
    cache = model.add_caching_hooks("blocks.0.hook_in")
    model(TOKENS)
    model.reset_hooks()
    assert list(cache) == ["blocks.0.hook_in"] and model.attached_hooks() == {}
    # Gradients under the alias too.
    _, grads = model.run_with_cache(TOKENS, names_filter="blocks.0.hook_out", incl_bwd=True, return_type="loss")
    assert set(grads.keys()) == {"blocks.0.hook_out", "blocks.0.hook_out_grad"}


def act_names(model: wb.Decoder) -> list[str]:
    """Every name ``utils.get_act_name`` returns for this model's points, through each of its spellings."""
    cfg = model.cfg
    names = [utils.get_act_name("embed"), utils.get_act_name("scale"), utils.get_act_name("normalized")]
    if cfg.positional in ("learned", "sinusoidal"):
        names.append(utils.get_act_name("pos_embed"))
    per_layer = ["resid_pre", "resid_post", "attn_out", "in", "out", "q", "k", "v", "z", "result", "pattern",
                 "attn", "attn_scores", "attn_logits", "key", "query", "value", "q_input", "k_input", "v_input"]
    if cfg.positional == "rotary":
        per_layer += ["rot_q", "rot_k"]
    if not cfg.attn_only:
        per_layer += ["resid_mid", "mlp_out", "pre", "post", "mlp_pre", "mlp_post"]
        if cfg.gated_mlp:
            per_layer.append("pre_linear")
    for layer in range(cfg.n_layers):
        names += [utils.get_act_name(short, layer) for short in per_layer]
        names += [utils.get_act_name(short, layer, "a") for short in ("q", "k", "v", "z", "pattern")]
        names += [utils.get_act_name(f"{short}{layer}") for short in ("k", "v", "pre", "post", "pattern")
                  if short in per_layer]
        for ln in ("ln1", "ln2") if not cfg.attn_only else ("ln1",):
            names += [utils.get_act_name("scale", layer, ln), utils.get_act_name("normalized", layer, ln),
                      utils.get_act_name(f"scale{layer}{ln}")]
    return names


@pytest.mark.parametrize("variant", ["gqa_rotary_rms_swiglu", "mha_learned_ln", "attn_only_tied"])
def test_every_get_act_name_name_resolves(variant):
    model = make_model(variant)
    model.set_use_attn_result(True)
    model.set_use_split_qkv_input(True)  # hook_q_input/k_input/v_input fire only then, as in TransformerLens
    names = list(dict.fromkeys(act_names(model)))
    model.check_hook_names(names)
    _, cache = model.run_with_cache(TOKENS, names_filter=names)
    assert set(cache.keys()) == set(names)


@pytest.mark.parametrize("wrong, meant", [
    ("blocks.0.attn.hook_out", "blocks.0.hook_attn_out"),
    ("blocks.1.mlp.hook_out", "blocks.1.hook_mlp_out"),
    ("blocks.1.mlp.hook_in", "blocks.1.ln2.hook_normalized"),
    ("blocks.0.hook_input", "blocks.0.hook_resid_pre"),
    ("embed.hook_out", "hook_embed"),
])
def test_did_you_mean_ranks_the_same_meaning_first(wrong, meant):
    model = make_model("gqa_rotary_rms_swiglu")
    with pytest.raises(wb.InputError, match=rf"did you mean '{meant}'"):
        model.run_with_hooks(TOKENS, fwd_hooks=[(wrong, lambda x, hook: x)])
    assert model.attached_hooks() == {}


# ---- refactor_factored_attn_matrices, centring under RMSNorm, enable_compatibility_mode ----------------------
@pytest.mark.parametrize("name", ["mha_learned_ln", "alibi_gelu_new", "sinusoidal_prenorm"])
def test_refactor_matches_transformer_lens_weights_and_keeps_log_probs(name):
    from transformer_lens.weight_processing import ProcessWeights

    from tests.unit.processing_variants import build, transformer_lens_state

    model = build(name)
    before = model(TOKENS).log_softmax(-1)
    state, tl_cfg = transformer_lens_state(model)
    expected = ProcessWeights.process_weights(state, tl_cfg, fold_ln=True, center_writing_weights=True,
                                              center_unembed=True, fold_value_biases=True,
                                              refactor_factored_attn_matrices=True)
    model.process_weights_(refactor_factored_attn_matrices=True)
    assert model.cfg.weight_processing[-1] == "refactor_factored_attn_matrices"
    ours, _ = transformer_lens_state(model)
    # An SVD's singular vectors are unique up to sign: a query column and its key column may both be flipped
    # (their product is the same). Align each pair's sign with TransformerLens's, then compare everything.
    for layer in range(model.cfg.n_layers):
        p = f"blocks.{layer}.attn."
        Q_eff = torch.cat([ours[p + "W_Q"], ours[p + "b_Q"][:, None]], dim=1)  # [H, D+1, K]
        sign = torch.sign((Q_eff * torch.cat([expected[p + "W_Q"], expected[p + "b_Q"][:, None]], dim=1)).sum(1))
        for key in ("W_Q", "W_K"):
            ours[p + key] = ours[p + key] * sign[:, None, :]
        for key in ("b_Q", "b_K"):
            ours[p + key] = ours[p + key] * sign
    worst = {k: (ours[k] - expected[k]).abs().max().item() for k in expected}
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert not torch.allclose(ours["blocks.0.attn.W_O"], state["blocks.0.attn.W_O"], atol=1e-2)  # it did refactor
    torch.testing.assert_close(model(TOKENS).log_softmax(-1), before, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant, reason", [("gqa_rotary_rms_swiglu", "rotary positions"),
                                             ("mqa_partial_rotary", "rotary positions")])
def test_refactor_is_refused_where_transformer_lens_refuses(variant, reason):
    model = make_model(variant)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(wb.ConfigError, match=rf"refactor_factored_attn_matrices: .*{reason}"):
        model.process_weights_(refactor_factored_attn_matrices=True)
    assert model.cfg.weight_processing == ()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_center_writing_weights_on_rmsnorm_warns_and_skips():
    model = make_model("gqa_rotary_rms_swiglu")
    before = model(TOKENS).log_softmax(-1)
    with pytest.warns(UserWarning, match="center_writing_weights skipped"):
        model.process_weights_(fold_ln=True, center_writing_weights=True, center_unembed=True)
    assert model.cfg.weight_processing == ("fold_ln", "center_unembed", "fold_value_biases")
    torch.testing.assert_close(model(TOKENS).log_softmax(-1), before, atol=1e-5, rtol=0)


def test_enable_compatibility_mode_applies_transformer_lens_defaults():
    import inspect

    from transformer_lens.model_bridge import TransformerBridge

    bridge_defaults = {k: p.default for k, p in inspect.signature(TransformerBridge.enable_compatibility_mode).parameters.items()
                       if k != "self"}
    ours = {k: p.default for k, p in inspect.signature(wb.Decoder.enable_compatibility_mode).parameters.items()
            if k != "self"}
    assert ours == bridge_defaults
    model = make_model("mha_learned_ln")
    assert model.enable_compatibility_mode() is None
    assert model.cfg.weight_processing == ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")
    rms = make_model("gqa_rotary_rms_swiglu")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # disable_warnings: the skipped centring says nothing
        rms.enable_compatibility_mode(disable_warnings=True)
    assert rms.cfg.weight_processing == ("fold_ln", "center_unembed", "fold_value_biases")
    untouched = make_model("mha_learned_ln")
    untouched.enable_compatibility_mode(no_processing=True)
    assert untouched.cfg.weight_processing == ()
