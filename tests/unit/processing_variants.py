"""The models weight processing is tested on: every unit-test variant of tests/unit/helpers.py and a few more
(``EXTRA``), built with spread-out weights so that a wrong fold cannot hide under the tolerance; and
``transformer_lens_state``, a model's weights in TransformerLens's state-dict layout, for comparing with its
``ProcessWeights``.
"""

from __future__ import annotations

import types

import torch

import workbench as wb
from tests.unit.helpers import make_model

# Beyond helpers.VARIANTS: biased GQA/MQA (value biases folded per query head), a pre-norm model with a
# sinusoidal table, and a LayerNorm mixture of experts whose ln2 biases are zero (nothing to refuse).
EXTRA = {
    "gqa_rms_biased": ("gqa_rotary_rms_swiglu", dict(attn_bias=True, mlp_bias=True, unembed_bias=True)),
    "mqa_ln_biased": ("mqa_partial_rotary", dict(attn_bias=True)),
    "sinusoidal_prenorm": ("sinusoidal_postnorm", dict(norm_placement="pre")),
    "moe_ln": ("moe_gqa", dict(normalization="LN")),
}


def build(name: str, seed: int = 0) -> wb.Decoder:
    """A helpers variant with spread-out weights: matrices ~N(0, 0.2), every bias (Q/K/V too) random.

    At make_model's N(0, 0.02) the log-probabilities hardly move from -log(d_vocab), so a wrong fold
    could hide under the tolerance; here attention is peaked and log-probabilities span ~7 nats.
    """
    variant, overrides = EXTRA.get(name, (name, {}))
    model = make_model(variant, seed=seed, **overrides)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            leaf = param_name.rsplit(".", 1)[-1]
            if leaf in ("_b_Q_lin", "_b_K_lin", "_b_V_lin"):
                param.normal_(0.0, 0.3)
            elif leaf not in ("w", "b") and not leaf.startswith("b_"):
                param.mul_(10.0)
        if name == "moe_ln":
            for block in model.blocks:
                block.ln2.b.zero_()
    return model


def transformer_lens_state(model: wb.Decoder):
    """The model's weights as a HookedTransformer state dict (missing biases as zeros) and a TL-style cfg."""
    cfg = model.cfg
    gqa = "_" if cfg.n_key_value_heads != cfg.n_heads else ""

    def take(tensor, *zeros_shape):
        return torch.zeros(zeros_shape) if tensor is None else tensor.detach().clone()

    state = {"embed.W_E": take(model.W_E), "unembed.W_U": take(model.W_U), "unembed.b_U": take(model.b_U),
             "ln_final.w": take(model.ln_final.w)}
    if cfg.positional == "learned":
        state["pos_embed.W_pos"] = take(model.W_pos)
    if cfg.normalization == "LN":
        state["ln_final.b"] = take(model.ln_final.b)
    H, G, K, D, M = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model, cfg.d_mlp
    for layer, block in enumerate(model.blocks):
        p, attn = f"blocks.{layer}.", block.attn
        state.update({p + "ln1.w": take(block.ln1.w), p + "attn.W_Q": take(attn.W_Q),
                      p + f"attn.{gqa}W_K": take(attn._W_K), p + f"attn.{gqa}W_V": take(attn._W_V),
                      p + "attn.W_O": take(attn.W_O), p + "attn.b_Q": take(attn.b_Q, H, K),
                      p + f"attn.{gqa}b_K": take(attn._b_K, G, K), p + f"attn.{gqa}b_V": take(attn._b_V, G, K),
                      p + "attn.b_O": take(attn.b_O, D)})
        if cfg.normalization == "LN":
            state[p + "ln1.b"] = take(block.ln1.b)
        if block.has_mlp:
            mlp = block.mlp
            state.update({p + "ln2.w": take(block.ln2.w), p + "mlp.W_in": take(mlp.W_in),
                          p + "mlp.b_in": take(mlp.b_in, M), p + "mlp.W_out": take(mlp.W_out),
                          p + "mlp.b_out": take(mlp.b_out, D)})
            if cfg.gated_mlp:
                state.update({p + "mlp.W_gate": take(mlp.W_gate), p + "mlp.b_gate": take(mlp.b_gate, M)})
            if cfg.normalization == "LN":
                state[p + "ln2.b"] = take(block.ln2.b)
    tl_cfg = types.SimpleNamespace(
        n_layers=cfg.n_layers, n_heads=H, d_head=K, d_model=D, d_vocab=cfg.d_vocab, d_mlp=M,
        normalization_type=cfg.normalization, n_key_value_heads=G if gqa else None,
        # our sinusoidal table is a fixed buffer, no weight: TransformerLens is told there is no W_pos
        positional_embedding_type={"learned": "standard", "sinusoidal": "none"}.get(cfg.positional, cfg.positional),
        attn_only=cfg.attn_only, gated_mlp=cfg.gated_mlp, num_experts=None, act_fn=cfg.act_fn, final_rms=False)
    return state, tl_cfg
