"""The models weight processing is tested on: every unit-test variant of tests/unit/helpers.py and a few more
(``EXTRA``), built with spread-out weights so that a wrong fold cannot hide under the tolerance.
"""

from __future__ import annotations

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
