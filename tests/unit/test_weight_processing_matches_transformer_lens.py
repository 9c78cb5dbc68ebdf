"""Weight processing (``Decoder.process_weights_``) gives the weights TransformerLens's own
``ProcessWeights.process_weights`` gives when run on the same weights in TransformerLens's state-dict layout.
"""

from __future__ import annotations

import types

import pytest
import torch
from transformer_lens.weight_processing import ProcessWeights

import workbench as wb
from tests.unit.processing_variants import build


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


@pytest.mark.parametrize("name", ["mha_learned_ln", "alibi_gelu_new", "attn_only_tied", "mqa_ln_biased",
                                  "gqa_rms_biased", "gqa_rotary_rms_swiglu", "sinusoidal_prenorm"])
def test_weights_equal_transformer_lens_process_weights(name):
    model = build(name)
    state, tl_cfg = transformer_lens_state(model)
    layer_norm = model.cfg.normalization == "LN"
    expected = ProcessWeights.process_weights(state, tl_cfg, fold_ln=True, center_writing_weights=layer_norm,
                                              center_unembed=True, fold_value_biases=True)
    model.process_weights_(center_writing_weights=layer_norm)
    ours, _ = transformer_lens_state(model)
    assert set(ours) == set(expected)
    changed = [k for k in expected if not torch.allclose(expected[k], state[k])]
    assert len(changed) > len(expected) // 3, "TransformerLens changed too little for this to discriminate"
    worst = {k: (ours[k] - expected[k]).abs().max().item() for k in expected}
    assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
