"""``stop_at_layer_for``: a forward runs just far enough for the hooks asked for, and the final norm's hooks (after
the blocks) make it run in full. Before it, SAE activations at ``ln_final.hook_normalized`` were read from a forward
stopped at ``n_layers``, where that hook never fires."""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from experiments._depth import hook_layer, stop_at_layer_for
from experiments.sae.activations import activation_chunks
from experiments.sae.inputs import hook_widths


@pytest.fixture(scope="module")
def model():
    return wb.load_model("toy-attn-2l", progress=False).eval()


def test_the_depth_is_the_block_after_the_deepest_hook(model):
    # toy-attn-2l has two blocks: block l's hooks need blocks 0..l, i.e. stop_at_layer = l + 1
    assert stop_at_layer_for(model, ["blocks.0.hook_resid_post"]) == 1
    assert stop_at_layer_for(model, ["blocks.0.attn.hook_z", "blocks.1.hook_resid_pre"]) == 2
    assert stop_at_layer_for(model, ["hook_embed"]) == 0
    assert stop_at_layer_for(model, ["blocks.1.hook_resid_post", "ln_final.hook_normalized"]) is None
    assert (hook_layer(model, "ln_final.hook_normalized"), hook_layer(model, "hook_pos_embed")) == (1, -1)


def test_every_hook_asked_for_fires_at_that_depth(model):
    tokens = model.to_tokens("The cat sat on the mat")
    for names in (["hook_embed"], ["blocks.0.hook_resid_post"], ["blocks.1.hook_resid_post", "ln_final.hook_normalized"]):
        _, cache = model.run_with_cache(tokens, names_filter=names, stop_at_layer=stop_at_layer_for(model, names),
                                        return_type=None)
        assert sorted(cache.keys()) == sorted(names)


def test_sae_activations_at_the_final_norm_are_read(model):
    tokens = model.to_tokens(["The cat sat on the mat", "A dog ran in the park"])
    hook = "ln_final.hook_normalized"
    assert hook_widths(model, [hook], tokens) == (model.cfg.d_model, model.cfg.d_model)
    _, rows_Ni = next(activation_chunks(model, tokens, [hook], 2, stop_at_layer_for(model, [hook])))
    _, cache = model.run_with_cache(tokens, names_filter=[hook])
    # the chunk holds the full forward's final-norm outputs at every position, in order
    torch.testing.assert_close(rows_Ni, cache[hook].reshape(-1, model.cfg.d_model))
