"""Padded batches on CUDA (skipped without CUDA): each row of a left- or right-padded batch equals its prompt
run alone under eager, sdpa and flash, batched greedy generation equals each prompt alone, and a
batched head patching over the padded prompts equals the mean of the single-prompt runs.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]

import workbench as wb
from experiments.patching import patch_heads

LENGTHS = (37, 90, 130)  # over one 64-key tile, so the masked tiles and the partial ones both occur
LLAMA = dict(n_layers=3, d_model=256, n_heads=8, n_key_value_heads=2, d_mlp=512, d_vocab=500, n_ctx=512,
             normalization="RMS", positional="rotary", act_fn="silu", gated_mlp=True, sliding_window=48)


def model():
    torch.manual_seed(0)
    return wb.Decoder(wb.ModelConfig(**LLAMA)).to("cuda").eval()


def prompts():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 500, (n,), generator=generator).cuda() for n in LENGTHS]


def padded(rows, side):
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(tokens)
    for i, row in enumerate(rows):
        where = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
        tokens[i, where], mask[i, where] = row, 1
    return tokens, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("kernel", ["eager", "sdpa", "flash"])
def test_each_padded_row_equals_its_prompt_alone_on_cuda(kernel, side):
    decoder = model().set_attn_impl(kernel)
    rows = prompts()
    tokens, mask = padded(rows, side)
    with torch.no_grad():
        logits = decoder(tokens, attention_mask=mask)
        for i, row in enumerate(rows):
            alone = decoder(row[None])[0]
            assert (logits[i][mask[i].bool()] - alone).abs().max() < 1e-4


def test_batched_greedy_generation_equals_each_prompt_alone_on_cuda():
    decoder = model().set_attn_impl("flash")
    rows = prompts()
    tokens, mask = padded(rows, "left")
    from workbench.generation import generate_tokens

    batched, _ = generate_tokens(decoder, tokens, 12, attention_mask=mask, stop_at_eos=False)
    for i, row in enumerate(rows):
        alone, _ = generate_tokens(decoder, row[None], 12, stop_at_eos=False)
        assert batched[i, -12:].tolist() == alone[0, -12:].tolist()


def test_batched_head_patching_is_the_mean_of_single_prompts_on_cuda():
    decoder = model().set_attn_impl("sdpa")
    clean = prompts()
    corrupt = [row.clone() for row in clean]
    for row in corrupt:
        row[-3] = (row[-3] + 7) % 500
    (c, cm), (k, km) = padded(clean, "right"), padded(corrupt, "right")
    batch = patch_heads(decoder, c, k, [5, 6, 7], [8, 9, 10], False, clean_mask=cm, corrupt_mask=km)
    singles = [patch_heads(decoder, a[None], b[None], ans, wrong, False)
               for a, b, ans, wrong in zip(clean, corrupt, [5, 6, 7], [8, 9, 10])]
    mean = sum(df.metric.values for df in singles) / len(singles)
    assert abs(batch.metric.values - mean).max() < 1e-4
