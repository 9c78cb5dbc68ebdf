"""Padded batches with an attention mask: each row's logits, activations and loss equal that prompt run
alone (the expected values are the unpadded runs), under every kernel, left and right padding,
for rotary, learned and ALiBi positions, with GQA and a sliding window shorter than the prompts."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

import workbench as wb
from workbench.generation import KVCache
from workbench.tokenizer import SpecialTokens, Tokenizer

KERNELS = ["eager", "sdpa", "flash"]
LENGTHS = (5, 8, 11)  # three prompt lengths, all longer than the window
VOCAB = 50


def make_model(positional: str) -> wb.Decoder:
    torch.manual_seed(0)
    cfg = wb.ModelConfig(n_layers=2, d_model=48, n_heads=6, n_key_value_heads=2, d_vocab=VOCAB, n_ctx=32,
                         positional=positional, normalization="RMS", gated_mlp=True, act_fn="silu",
                         sliding_window=4)
    words = BackendTokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = Tokenizer(words, SpecialTokens(bos_token="w1", eos_token="w2", pad_token="w0"))
    return wb.Decoder(cfg, tokenizer=tokenizer).eval()


def prompts() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in LENGTHS]


def padded(rows: list[torch.Tensor], side: str, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        where = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
        tokens[index, where], mask[index, where] = row, 1
    return tokens, mask


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("positional", ["rotary", "learned", "alibi"])
def test_each_row_equals_its_prompt_alone(positional, side, kernel):
    model = make_model(positional).set_attn_impl(kernel)
    rows = prompts()
    tokens, mask = padded(rows, side, pad=7)  # a pad id that is also a real word: only the mask hides it
    names = ("blocks.1.hook_resid_post", "blocks.0.attn.hook_z", "blocks.1.mlp.hook_post")
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, attention_mask=mask, names_filter=lambda n: n in names)
        losses = model(tokens, attention_mask=mask, return_type="loss", loss_per_token=True)
        for index, row in enumerate(rows):
            real = mask[index].bool()
            alone_logits, alone_cache = model.run_with_cache(row[None], names_filter=lambda n: n in names)
            assert (logits[index][real] - alone_logits[0]).abs().max() < 1e-5
            for name in names:
                assert (cache[name][index][real] - alone_cache[name][0]).abs().max() < 1e-5, name
            alone_loss = model(row[None], return_type="loss", loss_per_token=True)[0]
            scored = (mask[index, :-1] & mask[index, 1:]).bool()
            assert (losses[index][scored] - alone_loss).abs().max() < 1e-5
            assert (losses[index][~scored] == 0).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_patterns_give_pads_no_weight_and_the_mean_loss_skips_them(kernel):
    model = make_model("rotary").set_attn_impl(kernel)
    rows = prompts()
    tokens, mask = padded(rows, "left")
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, attention_mask=mask, names_filter=lambda n: n.endswith("hook_pattern"))
        pattern = cache["blocks.0.attn.hook_pattern"]  # [batch, heads, query, key]
        real_queries = mask.bool()[:, None, :, None]
        pad_keys = ~mask.bool()[:, None, None, :]
        assert (pattern.masked_select(real_queries & pad_keys) == 0).all()
        assert not pattern.isnan().any()
        batch_loss = model(tokens, attention_mask=mask, return_type="loss")
        per_prompt = [model(row[None], return_type="loss", loss_per_token=True)[0] for row in rows]
    expected = torch.cat(per_prompt).mean()  # one mean over every scored token of every prompt
    assert abs(batch_loss.item() - expected.item()) < 1e-5


def test_a_list_of_texts_builds_its_own_mask():
    model = make_model("rotary")
    texts = ["w5 w6 w7 w8", "w9", "w10 w11"]
    with torch.no_grad():
        for side in ("right", "left"):
            logits = model(texts, padding_side=side)
            tokens, mask = model.to_tokens_and_mask(texts, padding_side=side)
            assert torch.equal(model.to_tokens(texts, padding_side=side), tokens)
            for index, text in enumerate(texts):
                alone = model(text)[0]
                assert (logits[index][mask[index].bool()] - alone).abs().max() < 1e-5
    assert mask.tolist()[1] == [0, 0, 0, 1, 1] and tokens[1, 3:].tolist() == [1, 9]  # left: 3 pads, BOS, w9


def test_kv_cached_decoding_of_a_left_padded_batch_equals_each_prompt_alone():
    model = make_model("rotary")
    rows = prompts()
    tokens, mask = padded(rows, "left")
    continuation = torch.randint(3, VOCAB, (len(rows), 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = KVCache(model.cfg.n_layers)
        model(tokens, attention_mask=mask, kv_cache=cache)
        steps = [model(continuation[:, t:t + 1], kv_cache=cache)[:, -1] for t in range(continuation.shape[1])]
        for index, row in enumerate(rows):
            alone = model(torch.cat([row, continuation[index]])[None])[0, len(row):]
            assert (torch.stack([step[index] for step in steps]) - alone).abs().max() < 1e-5


@pytest.mark.parametrize("mask, message", [
    (torch.ones(3, 5, dtype=torch.long), r"attention_mask has shape \(3, 5\) but the tokens have \(3, 11\)"),
    (torch.full((3, 11), 2), r"only 1 \(a real token\) and 0"),
])
def test_bad_masks_are_refused_by_name(mask, message):
    model = make_model("rotary")
    tokens, _ = padded(prompts(), "right")
    with pytest.raises(wb.InputError, match=message):
        model(tokens, attention_mask=mask)


def test_an_all_padding_row_is_refused():
    model = make_model("rotary")
    tokens, mask = padded(prompts(), "right")
    mask[1] = 0
    with pytest.raises(wb.InputError, match=r"row\(s\) \[1\] of attention_mask are all padding"):
        model(tokens, attention_mask=mask)
    assert all(not hook._forward_hooks for hook in model.hook_dict.values())


def test_batched_greedy_generation_equals_each_prompt_alone():
    model = make_model("rotary")
    texts = ["w5 w6 w7 w8 w9 w10", "w11", "w12 w13 w14"]
    batched = model.generate(texts, max_new_tokens=6)
    assert batched == [model.generate(text, max_new_tokens=6) for text in texts]
    tokens, mask = model.to_tokens_and_mask(texts, padding_side="left")
    from workbench.generation import generate_tokens

    for use_kv_cache in (True, False):
        out, _ = generate_tokens(model, tokens, 6, attention_mask=mask, use_kv_cache=use_kv_cache, stop_at_eos=False)
        for index, text in enumerate(texts):
            alone, _ = generate_tokens(model, model.to_tokens(text), 6, stop_at_eos=False)
            assert out[index, -6:].tolist() == alone[0, -6:].tolist()


def test_generation_refuses_right_padding():
    model = make_model("rotary")
    tokens, mask = model.to_tokens_and_mask(["w5 w6 w7", "w8"], padding_side="right")
    from workbench.generation import generate_tokens

    with pytest.raises(wb.InputError, match="left padding"):
        generate_tokens(model, tokens, 3, attention_mask=mask)
