"""The Decoder's public surface for experiments: kernel switching, the output head, the loss, hook layers, tokens.

Expected values come from hand calculations or straight from torch (``F.cross_entropy``, matmuls),
never from the method under test.
"""

import pytest
import torch
import torch.nn.functional as F

import workbench as wb
import workbench.loss
from workbench.components import attention as attention_module
from tests.unit.helpers import make_model

TOKENS = torch.tensor([[1, 5, 9, 2, 7, 3, 3, 8], [4, 4, 6, 0, 1, 2, 9, 5]])


@pytest.mark.parametrize("variant", ["gqa_rotary_rms_swiglu", "sliding_window_gqa", "alibi_gelu_new"])
def test_set_attn_impl_switches_every_layer_of_a_loaded_model(variant, monkeypatch):
    model = make_model(variant, attn_impl="eager")
    reference = model(TOKENS)
    calls = []
    for impl in ("flash", "sdpa"):
        kernel = attention_module.FAST_KERNELS[impl]
        monkeypatch.setitem(attention_module.FAST_KERNELS, impl,
                            lambda *args, impl=impl, kernel=kernel: calls.append(impl) or kernel(*args))
    for impl in ("flash", "sdpa", "eager"):
        calls.clear()
        assert model.set_attn_impl(impl) is model
        assert model.cfg.attn_impl == impl and {b.attn.attn_impl for b in model.blocks} == {impl}
        torch.testing.assert_close(model(TOKENS), reference, rtol=0, atol=2e-5)
        assert calls == ([] if impl == "eager" else [impl] * model.cfg.n_layers)


def test_set_attn_impl_refuses_an_unknown_kernel_and_keeps_the_old_one():
    model = make_model("mha_learned_ln", attn_impl="sdpa")
    with pytest.raises(wb.ConfigError, match="attn_impl"):
        model.set_attn_impl("flashy")
    assert model.cfg.attn_impl == "sdpa" and {b.attn.attn_impl for b in model.blocks} == {"sdpa"}


def test_no_component_keeps_a_copy_of_the_config_and_to_keeps_the_model_config_current():
    model = make_model("moe_gqa")
    assert [name for name, module in model.named_modules() if module is not model and hasattr(module, "cfg")] == []
    model.to(torch.float64)
    assert model.cfg.dtype == torch.float64 and model(TOKENS).dtype == torch.float64


def test_layer_of_names_the_block_or_refuses_an_unknown_hook():
    model = make_model("gqa_rotary_rms_swiglu")
    assert model.layer_of("blocks.1.attn.hook_z") == 1
    assert model.layer_of("blocks.0.ln2.hook_scale") == 0
    assert model.layer_of("hook_embed") is None and model.layer_of("ln_final.hook_normalized") is None
    with pytest.raises(wb.InputError, match="blocks.0.attn.hook_zz"):
        model.layer_of("blocks.0.attn.hook_zz")
    with pytest.raises(wb.InputError, match="blocks.7.attn.hook_z"):
        model.layer_of("blocks.7.attn.hook_z")  # no block 7 in a 2-layer model


@pytest.mark.parametrize("variant", ["mha_learned_ln", "gqa_rotary_rms_swiglu", "sinusoidal_postnorm"])
def test_logits_from_resid_and_loss_fn_reproduce_the_forward(variant):
    model = make_model(variant)
    logits, cache = model.run_with_cache(TOKENS)
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    torch.testing.assert_close(model.logits_from_resid(final), logits, rtol=0, atol=1e-6)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, model.cfg.d_vocab), TOKENS[:, 1:].reshape(-1))
    torch.testing.assert_close(model.loss_fn(logits, TOKENS), expected, rtol=0, atol=1e-6)
    assert model.loss_fn(logits, TOKENS, per_token=True).shape == (2, 7)


@pytest.mark.parametrize("tiles", [(2048, 1024), (3, 16)])
def test_loss_from_resid_equals_cross_entropy_of_the_full_logits(tiles, monkeypatch):
    # Tiles of 3 positions x 16 of the 61 vocabulary entries split rows and put targets in every tile.
    monkeypatch.setattr(workbench.loss, "TILE_POSITIONS", tiles[0])
    monkeypatch.setattr(workbench.loss, "TILE_VOCAB", tiles[1])
    model = make_model("mha_learned_ln")
    logits, cache = model.run_with_cache(TOKENS)
    final = cache["blocks.1.hook_resid_post"]
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 61), TOKENS[:, 1:].reshape(-1), reduction="none").view(2, 7)
    torch.testing.assert_close(model.loss_from_resid(final[:, :-1], TOKENS[:, 1:]), expected, rtol=0, atol=1e-5)


def test_frozen_scale_final_norm_is_the_linear_part_by_hand():
    cfg = wb.ModelConfig(n_layers=1, d_model=2, n_heads=1, d_vocab=3, n_ctx=4, normalization="LN")
    model = wb.Decoder(cfg)
    with torch.no_grad():
        model.ln_final.w.copy_(torch.tensor([2.0, 3.0]))
        model.ln_final.b.copy_(torch.tensor([0.5, -1.0]))
    # (x - mean) / scale * w, no bias: [1, 3] -> [-1, 1] / 2 * [2, 3] = [-1, 1.5]
    out = model.apply_final_norm(torch.tensor([[1.0, 3.0]]), frozen_scale=torch.tensor([[2.0]]))
    assert out.tolist() == [[-1.0, 1.5]]
    # a LayerNorm of zeros is its bias (0 / sqrt(eps) * w + b)
    assert model.apply_final_norm(torch.zeros(1, 2)).tolist() == [[0.5, -1.0]]
    # The parts of a sum, each normed with the sum's scale, add up to the norm of the sum (plus the bias once).
    a, b = torch.tensor([[1.0, 4.0]]), torch.tensor([[2.0, -3.0]])  # a + b = [3, 1]: centred [1, -1], std 1
    scale = torch.tensor([[(1.0 + cfg.norm_eps) ** 0.5]])
    parts = model.apply_final_norm(a, frozen_scale=scale) + model.apply_final_norm(b, frozen_scale=scale)
    torch.testing.assert_close(parts + model.ln_final.b, model.apply_final_norm(a + b), rtol=0, atol=1e-6)


def test_tokens_to_residual_directions_read_out_one_logit():
    model = make_model("gqa_rotary_rms_swiglu")
    x = torch.randn(3, model.cfg.d_model)
    logits = model.logits_from_resid(x[None])[0]
    normed = model.apply_final_norm(x)
    torch.testing.assert_close(normed @ model.tokens_to_residual_directions(5), logits[:, 5], rtol=0, atol=1e-5)
    assert model.tokens_to_residual_directions(torch.tensor([[1, 2, 3]])).shape == (1, 3, model.cfg.d_model)


def test_as_tokens_checks_what_it_is_given():
    model = make_model("mha_learned_ln")
    assert model.as_tokens(torch.tensor([3, 4, 5])).tolist() == [[3, 4, 5]]
    for bad, message in ((torch.tensor([[1.0, 2.0]]), "integer"), (torch.tensor([[1, 61]]), "token id 61"),
                         (torch.zeros(1, 65, dtype=torch.long), "n_ctx=64"), (torch.zeros(1, 0, dtype=torch.long), "empty"),
                         (torch.zeros(1, 1, 2, dtype=torch.long), r"\[batch, pos\]"), (3.0, "expected text")):
        with pytest.raises(wb.InputError, match=message):
            model.as_tokens(bad)
    with pytest.raises(wb.InputError, match="no tokenizer"):
        model.as_tokens("text needs a tokenizer")
