"""Small configs shared by the decoder's unit tests."""

import torch

import workbench as wb
from workbench.options import split_saved_config

BASE = dict(n_layers=2, d_model=32, n_heads=4, d_vocab=61, n_ctx=64)

# One config per attention layout / positional scheme / block type the decoder supports.
VARIANTS = {
    "mha_learned_ln": dict(positional="learned", normalization="LN", act_fn="gelu"),
    "gqa_rotary_rms_swiglu": dict(n_key_value_heads=2, positional="rotary", normalization="RMS",
                                  gated_mlp=True, act_fn="silu"),
    "mqa_partial_rotary": dict(n_key_value_heads=1, positional="rotary", rotary_dim=4),
    "sinusoidal_postnorm": dict(positional="sinusoidal", norm_placement="post", act_fn="relu"),
    "alibi_gelu_new": dict(positional="alibi", act_fn="gelu_new", attn_bias=True, mlp_bias=True),
    "moe_gqa": dict(n_key_value_heads=2, positional="rotary", normalization="RMS", gated_mlp=True,
                    act_fn="silu", num_experts=4, experts_per_token=2),
    "attn_only_tied": dict(attn_only=True, tie_embeddings=True, positional="rotary"),
    "sliding_window_gqa": dict(n_key_value_heads=2, positional="rotary", sliding_window=5),
}


def make_model(variant: str, seed: int = 0, **overrides) -> wb.Decoder:
    """``overrides``: architecture fields and runtime options (``attn_impl=``, ``dtype=`` ...) alike."""
    torch.manual_seed(seed)
    cfg, options = split_saved_config({**BASE, **VARIANTS[variant], **overrides})
    model = wb.Decoder(cfg, **options)
    # Random (not default) norm gains and biases, so formulas are exercised with non-trivial values.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".w", ".b")) or ".b_" in name or "._b_" in name:  # _b_*_lin: Q/K/V bias storage
                param.normal_(1.0 if name.endswith(".w") else 0.0, 0.1)
    return model.eval()


def same_weights(model: wb.Decoder, **changes) -> wb.Decoder:
    """A copy of ``model`` with architecture fields or runtime options changed (e.g. attn_impl) and identical weights."""
    cfg, options = split_saved_config({**model.cfg.to_dict(), **changes})
    other = wb.Decoder(cfg, init_weights=False, **options)
    other.load_state_dict(model.state_dict())
    return other.eval()
