"""MiniCPM3 loads at parity with transformers (``family_parity``): DeepSeek-V2's latent attention
with RoPE on halves (with and without the query bottleneck, YaRN with mscale), scaled embeddings, residual
branches scaled by scale_depth / sqrt(layers) (folded into the output weights) and logits scaled by
dim_model_base / hidden_size.

Tiny configs: d_model 48 over 4 heads, vocab 101, 2 layers, latent rank 16, query rank 24.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MiniCPM3Config

import workbench as wb
from tests.integration.family_parity import TOLERANCE, Case, family_parity_tests, max_diff, saved_on_demand
from tests.integration.test_family_llama import _copy

TINY = dict(vocab_size=101, hidden_size=48, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
            intermediate_size=80, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=2,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, scale_emb=3.0, scale_depth=1.4,
            dim_model_base=24)
YARN_MSCALE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
               "mscale": 0.707, "mscale_all_dim": 1.0}

CASES = {
    "minicpm3_query_bottleneck_tied": Case(lambda: MiniCPM3Config(**TINY, q_lora_rank=24)),
    "minicpm3_yarn_biases_untied": Case(lambda: MiniCPM3Config(**TINY, q_lora_rank=None, attention_bias=True,
                                                               tie_word_embeddings=False, rope_parameters=YARN_MSCALE)),
}

globals().update(family_parity_tests(CASES))


saved = saved_on_demand(CASES)


@pytest.mark.parametrize("field", ["scale_emb", "scale_depth", "dim_model_base"])
def test_each_multiplier_changes_the_logits(saved, field, tmp_path):
    case = saved("minicpm3_query_bottleneck_tied")
    with torch.no_grad():
        changed = wb.load_model(_copy(case.directory, tmp_path, lambda c: c.update({field: None})))(case.tokens)
    assert max_diff(changed, case.logits) > 100 * TOLERANCE


def test_unhonourable_scale_depth_is_refused_by_field(saved, tmp_path):
    directory = _copy(saved("minicpm3_query_bottleneck_tied").directory, tmp_path, lambda c: c.update(scale_depth="1.4"))
    with pytest.raises(wb.ConfigError, match="'scale_depth'"):
        wb.load_model(directory)
