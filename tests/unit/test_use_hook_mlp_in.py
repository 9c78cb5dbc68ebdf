"""``set_use_hook_mlp_in``: TransformerLens's switch for ``blocks.{l}.hook_mlp_in``, a runtime option like the others."""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.errors import ConfigError

BASE = dict(n_layers=2, d_model=16, n_heads=4, d_vocab=30, n_ctx=8)
TOKENS = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]])


def _model(**architecture):
    torch.manual_seed(0)
    return wb.Decoder(wb.ModelConfig(**{**BASE, **architecture}))


@pytest.mark.parametrize("architecture", [{}, {"norm_placement": "post"}, {"parallel_attn_mlp": True}])
def test_the_switch_changes_no_logit_on_or_off(architecture):
    model = _model(**architecture)
    with torch.no_grad():
        before = model(TOKENS)
        model.set_use_hook_mlp_in(True)
        assert model.cfg.use_hook_mlp_in and all(block.options is model.options for block in model.blocks)
        switched_on = model(TOKENS)  # the MLP reads a copy of the same values
        model.set_use_hook_mlp_in(False)
        assert not model.cfg.use_hook_mlp_in
        assert torch.equal(switched_on, before) and torch.equal(model(TOKENS), before)


def test_an_edit_at_hook_mlp_in_reaches_the_mlp_only():
    model = _model()
    model.set_use_hook_mlp_in(True)
    delta = torch.linspace(-1.0, 2.0, 16)  # not constant: the LayerNorm would centre a constant away
    seen = {}
    keep = lambda name: (lambda act, hook: seen.__setitem__(name, act.clone()))  # noqa: E731
    with torch.no_grad():
        model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.hook_mlp_in", lambda act, hook: act + delta),
                                                ("blocks.0.hook_resid_mid", keep("mid")),
                                                ("blocks.0.hook_mlp_out", keep("out"))])
        block = model.blocks[0]
        # by hand: the MLP reads ln2 of the edited copy; the residual stream keeps the unedited value
        expected = block.mlp(block.ln2(seen["mid"] + delta))
        _, cache = model.run_with_cache(TOKENS, names_filter="blocks.0.hook_resid_mid")
    torch.testing.assert_close(seen["out"], expected, atol=1e-6, rtol=0)
    assert torch.equal(seen["mid"], cache["blocks.0.hook_resid_mid"])


def test_an_attention_only_model_refuses_the_switch_and_changes_nothing():
    model = _model(attn_only=True)
    with pytest.raises(ConfigError, match="use_hook_mlp_in needs MLPs"):
        model.set_use_hook_mlp_in(True)
    assert model.cfg.use_hook_mlp_in is False
    with pytest.raises(ConfigError, match="use_hook_mlp_in"):
        wb.Decoder(wb.ModelConfig(**BASE, attn_only=True), use_hook_mlp_in=True)


def test_the_switch_is_checked_saved_and_read_through_cfg():
    with pytest.raises(ConfigError, match="use_hook_mlp_in must be True or False"):
        wb.RuntimeOptions(use_hook_mlp_in=1)
    assert wb.RuntimeOptions(use_hook_mlp_in=True).to_saved()["use_hook_mlp_in"] is True
    model = _model()
    model.cfg.use_hook_mlp_in = True  # TransformerLens's way: the model's one options object
    assert model.options.use_hook_mlp_in and wb.Decoder(model.cfg).cfg.use_hook_mlp_in


def test_cache_all_holds_hook_mlp_in_only_with_the_switch_on_as_transformer_lens():
    model = wb.load_model("toy-moe-2l")
    tokens = model.to_tokens("def f(x): return x")
    _, cache = model.run_with_cache(tokens)
    assert "blocks.0.hook_mlp_in" not in cache
    model.set_use_hook_mlp_in(True)
    try:
        _, cache = model.run_with_cache(tokens)
        assert "blocks.0.hook_mlp_in" in cache and "blocks.0.attn.hook_result" not in cache
        assert torch.equal(cache["blocks.0.hook_mlp_in"], cache["blocks.0.hook_resid_mid"])
    finally:
        model.set_use_hook_mlp_in(False)
