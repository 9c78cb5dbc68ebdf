"""The whole Decoder on CUDA: ``attn_impl="flash"`` (the Triton kernel) against ``"sdpa"`` (skipped without CUDA).

Same weights, same tokens; logits, gradients and patterns agree within the dtype's tolerance, and
a pattern hook still reads the eager pattern under ``flash``. Run in its own pytest process
(``pytest tests/gpu``), as the kernel tests beside it.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]

if CUDA:
    pytest.importorskip("triton", reason="triton is not installed (optional 'triton' extra)")
    from workbench.kernels import triton_flash as tf

    if tf._KERNELS_INTERPRETED:
        pytest.skip("triton was imported in interpreter mode in this process; run tests/gpu on its own",
                    allow_module_level=True)

import workbench as wb

# Llama-shaped: GQA 8 query / 2 KV heads, RoPE, RMSNorm, SwiGLU; head dims of both tile tables.
LLAMA = dict(n_layers=4, d_model=512, n_heads=8, n_key_value_heads=2, d_mlp=1024, d_vocab=1000, n_ctx=2048,
             normalization="RMS", positional="rotary", act_fn="silu", gated_mlp=True)
# (max abs logit difference allowed; logits are O(1) with this init)
LOGIT_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _pair(dtype, **overrides):
    torch.manual_seed(0)
    sdpa = wb.Decoder(wb.ModelConfig(**{**LLAMA, **overrides}), attn_impl="sdpa").to(device="cuda", dtype=dtype)
    flash = wb.Decoder(sdpa.cfg, init_weights=False, attn_impl="flash").to(device="cuda", dtype=dtype)
    flash.load_state_dict(sdpa.state_dict())
    return sdpa.eval(), flash.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 256}, {"n_heads": 4, "d_head": 128,
                                                                      "n_key_value_heads": 1}],
                         ids=["gqa", "window", "mqa_d128"])
def test_flash_logits_equal_sdpa(dtype, overrides):
    sdpa, flash = _pair(dtype, **overrides)
    tokens = torch.randint(0, LLAMA["d_vocab"], (2, 1000), device="cuda")
    with torch.no_grad():
        want, got = sdpa(tokens).float(), flash(tokens).float()
    assert (got - want).abs().max().item() <= LOGIT_TOL[dtype]


def test_flash_gradients_equal_sdpa():
    sdpa, flash = _pair(torch.float32)
    tokens = torch.randint(0, LLAMA["d_vocab"], (2, 513), device="cuda")
    sdpa(tokens, return_type="loss").backward()
    flash(tokens, return_type="loss").backward()
    for (name, p_sdpa), p_flash in zip(sdpa.named_parameters(), flash.parameters()):
        torch.testing.assert_close(p_flash.grad, p_sdpa.grad, atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


def test_pattern_hook_under_flash_reads_the_eager_pattern():
    sdpa, flash = _pair(torch.float32)
    eager = wb.Decoder(sdpa.cfg, init_weights=False, attn_impl="eager").to("cuda")
    eager.load_state_dict(sdpa.state_dict())
    tokens = torch.randint(0, LLAMA["d_vocab"], (1, 300), device="cuda")
    only_layer_2 = lambda name: name == "blocks.2.attn.hook_pattern"
    with torch.no_grad():
        flash_logits, flash_cache = flash.run_with_cache(tokens, names_filter=only_layer_2)
        eager_logits, eager_cache = eager.eval().run_with_cache(tokens, names_filter=only_layer_2)
    torch.testing.assert_close(flash_cache["blocks.2.attn.hook_pattern"], eager_cache["blocks.2.attn.hook_pattern"],
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(flash_logits, eager_logits, atol=1e-4, rtol=0)
