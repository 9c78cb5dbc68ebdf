"""Weight processing (``Decoder.process_weights_``) gives the weights TransformerLens's own
``ProcessWeights.process_weights`` gives when run on the same weights in TransformerLens's state-dict layout.
"""

from __future__ import annotations

import pytest
import torch
from transformer_lens.weight_processing import ProcessWeights

from tests.unit.processing_variants import build, transformer_lens_state


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
