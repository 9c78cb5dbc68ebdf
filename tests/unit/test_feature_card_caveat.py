"""A feature's direct logit effect carries a caveat when the feature writes before the last quarter of the layers
(the later layers transform what it writes), and none from there on."""

from __future__ import annotations

from types import SimpleNamespace

from app.feature_card import mid_layer_caveat


def thirty_layers():   # SmolLM2-135M's depth; only the config is read
    return SimpleNamespace(cfg=SimpleNamespace(n_layers=30))


def test_a_mid_layer_feature_carries_the_caveat_with_its_later_layers_counted():
    caveat = mid_layer_caveat(thirty_layers(), "blocks.14.hook_mlp_out")
    assert caveat.startswith("Layer 14 of 30 writes this feature") and "the 15 later layers" in caveat
    assert "weak evidence" in caveat
    assert mid_layer_caveat(thirty_layers(), "blocks.0.hook_resid_post") is not None
    assert mid_layer_caveat(thirty_layers(), "blocks.21.hook_mlp_out") is not None   # 22 layers of 30 < 3/4


def test_a_late_layer_feature_has_none():
    for hook in ("blocks.22.hook_mlp_out", "blocks.29.hook_resid_post", "ln_final.hook_normalized"):
        assert mid_layer_caveat(thirty_layers(), hook) is None, hook
