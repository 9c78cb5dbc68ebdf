"""Padded batches against transformers: the logits of a left- or right-padded batch with its attention mask,
at every real position, equal transformers' logits of the same batch and mask (1e-4, float32), under each of
our kernels.

Rotary (Llama with GQA, Mistral with a sliding window shorter than the prompts), learned positions
(GPT-2; OPT, whose transformers model derives positions from the mask itself) and ALiBi (BLOOM,
whose bias transformers builds from the mask's running count). Where a transformers model takes
``position_ids``, it gets each row's count from its first real token, as ``generate`` computes them.
"""

from __future__ import annotations

import pytest
import torch
from transformers import BloomConfig, GPT2Config, LlamaConfig, MistralConfig, OPTConfig

import workbench as wb
from tests.integration.family_parity import build_and_save
from tests.integration.hf_tiny import N_CTX, VOCAB

LENGTHS = (6, 11, 15)
KERNELS = ["eager", "sdpa", "flash"]
_SPECIAL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=2)
CONFIGS = {
    "llama_gqa": (lambda: LlamaConfig(**_SPECIAL, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=N_CTX),
                  True),
    "mistral_window": (lambda: MistralConfig(**_SPECIAL, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=6, num_key_value_heads=2, sliding_window=4,
                                             max_position_embeddings=N_CTX, head_dim=8), True),
    "gpt2_learned": (lambda: GPT2Config(**_SPECIAL, n_embd=48, n_layer=2, n_head=6, n_positions=N_CTX), True),
    "opt_learned_offset": (lambda: OPTConfig(**_SPECIAL, hidden_size=48, num_attention_heads=6, num_hidden_layers=2,
                                             ffn_dim=80, max_position_embeddings=N_CTX), False),
    "bloom_alibi": (lambda: BloomConfig(**_SPECIAL, hidden_size=48, n_head=6, n_layer=2), False),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory):
    config, takes_position_ids = CONFIGS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = build_and_save(config(), directory)
    return request.param, hf_model, wb.load_model(str(directory)).eval(), takes_position_ids


def padded_batch(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    width = max(LENGTHS)
    tokens = torch.full((len(LENGTHS), width), 2, dtype=torch.long)
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        where = slice(0, n) if side == "right" else slice(width - n, width)
        tokens[row, where] = torch.randint(3, VOCAB, (n,), generator=generator)
        mask[row, where] = 1
    return tokens, mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_logits_equal_transformers_at_every_real_position(saved, side):
    name, hf_model, ours, takes_position_ids = saved
    tokens, mask = padded_batch(side)
    extra = {"position_ids": (mask.cumsum(1) - 1).clamp(min=0)} if takes_position_ids else {}
    with torch.no_grad():
        expected = hf_model(tokens, attention_mask=mask, **extra).logits
        real = mask.bool()
        for kernel in KERNELS:
            logits = ours.set_attn_impl(kernel)(tokens, attention_mask=mask)
            difference = (logits[real] - expected[real]).abs().max().item()
            assert difference < 1e-4, f"{name} {side} {kernel}: {difference:.2e}"
