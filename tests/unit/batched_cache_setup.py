"""The model, dataset and one-shot references the batched run_with_cache tests share: two small decoders
(grouped-query with RoPE, or multi-head with learned positions and biases) with a word-level tokenizer, and
``B`` rows of ``LENGTHS`` real tokens, padded on either side or not at all.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

import workbench as wb
from workbench.tokenizer import SpecialTokens, Tokenizer

VOCAB = 50
LENGTHS = (9, 4, 7, 9, 2, 6, 8)  # B = 7 rows, P = 9; row 4 has one scored pair only
B, P = len(LENGTHS), max(LENGTHS)
ALL = None


def make_model(kind: str = "gqa") -> wb.Decoder:
    torch.manual_seed(0)
    sizes = dict(n_layers=2, d_model=32, n_heads=4, d_vocab=VOCAB, n_ctx=32)
    if kind == "gqa":
        cfg = wb.ModelConfig(**sizes, n_key_value_heads=2, positional="rotary", normalization="RMS",
                             gated_mlp=True, act_fn="silu")
    else:
        cfg = wb.ModelConfig(**sizes, positional="learned", normalization="LN", attn_bias=True, mlp_bias=True)
    words = BackendTokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = Tokenizer(words, SpecialTokens(bos_token="w1", eos_token="w2", pad_token="w0"))
    return wb.Decoder(cfg, tokenizer=tokenizer).eval()


def dataset(padding: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, P] ids and, when padded, the mask (rows of LENGTHS real tokens on that side)."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (B, P), generator=generator)
    if padding is None:
        return tokens, None
    mask = torch.zeros(B, P, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    if padding == "left":
        mask = mask.flip(1)
    return tokens, mask


def one_shot(model, tokens, mask, names_filter=ALL, **kwargs):
    with torch.no_grad():
        return model.run_with_cache(tokens, attention_mask=mask, names_filter=names_filter, **kwargs)


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for t in cache.values())


def assert_same_cache(cache, expected) -> None:
    assert sorted(cache.keys()) == sorted(expected.keys())
    for name, tensor in expected.items():
        got = cache[name]
        torch.testing.assert_close(got, tensor, atol=1e-5, rtol=0, msg=name)  # same shape, dtype; -inf scores equal


def no_hooks_left(model) -> bool:
    return all(not hp.fwd_hooks and not hp.bwd_hooks for hp in model.hook_dict.values())
