"""Our activations match TransformerLens's ``TransformerBridge`` on the same HF model.

Reference: ``TransformerBridge.boot_transformers(hf_model=..., tokenizer=...)`` (TransformerLens
4.3) wraps the very `transformers` model we saved, so nothing is fetched; we compare
``blocks.{l}.hook_resid_post`` and ``blocks.{l}.attn.hook_pattern`` of every layer
(max abs difference < 1e-4).
"""

from __future__ import annotations

import pytest
import torch
from transformer_lens.model_bridge import TransformerBridge
from transformers import PreTrainedTokenizerFast

import workbench as wb
from tests.integration.hf_tiny import FACTORIES, VOCAB, build_and_save

HOOKS = ("hook_resid_post", "hook_pattern")


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("architecture", list(FACTORIES))
@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_resid_post_and_pattern_match_transformer_bridge(tmp_path, tokens, architecture, attn_impl):
    hf_model = build_and_save(architecture, tmp_path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    bridge = TransformerBridge.boot_transformers(str(tmp_path), hf_model=hf_model, tokenizer=tokenizer, device="cpu")
    model = wb.load_model(tmp_path, attn_impl=attn_impl)
    keep = lambda name: name.endswith(HOOKS)  # noqa: E731
    with torch.no_grad():
        _, reference = bridge.run_with_cache(tokens, names_filter=keep)
        _, ours = model.run_with_cache(tokens, names_filter=keep)
    for layer in range(model.cfg.n_layers):
        for name in (f"blocks.{layer}.hook_resid_post", f"blocks.{layer}.attn.hook_pattern"):
            assert ours[name].shape == reference[name].shape, name
            assert (ours[name] - reference[name]).abs().max().item() < 1e-4, name
    # The patterns are not near-uniform, so the comparison above discriminates.
    assert reference["blocks.0.attn.hook_pattern"].max() > 0.5
