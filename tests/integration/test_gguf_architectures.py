"""Every GGUF architecture we read loads at parity with the transformers model it was converted from.

For each recipe of ``gguf_convert`` (one per llama.cpp architecture, two for llama and Falcon), a random
tiny transformers model is written as llama.cpp's converter writes it: float32 (logits and every
layer's residual stream within 1e-4 of transformers' eager run) and in one quantised block type
(logits within 1e-4 of the transformers model holding the dequantised weights). F16 and BF16 files
are checked the same way on one architecture.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from tests.integration.gguf_convert import Q, RECIPES, build, quantised_reference, write

TOLERANCE = 1e-4
TOKENS = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module", params=sorted(RECIPES))
def converted(request):
    model = build(request.param)
    with torch.no_grad():
        out = model(TOKENS, output_hidden_states=True)
    assert out.logits.abs().max() > 1.0, f"{request.param}: the reference logits are too flat to discriminate"
    return request.param, model, out


def test_float_file_matches_transformers(converted, tmp_path):
    name, _, out = converted
    model = wb.load_model(write(name, converted[1], tmp_path / f"{name}.gguf"), attn_impl="eager")
    L = model.cfg.n_layers
    names = [f"blocks.{l}.hook_resid_{kind}" for l in range(L) for kind in ("pre", "post")]
    with torch.no_grad():
        logits, cache = model.run_with_cache(TOKENS, names_filter=lambda n: n in names)
    assert max_diff(logits, out.logits) < TOLERANCE, name
    for layer in range(L):
        assert max_diff(cache[f"blocks.{layer}.hook_resid_pre"], out.hidden_states[layer]) < TOLERANCE, (name, layer)
        leaving = cache[f"blocks.{layer}.hook_resid_post"]
        if layer == L - 1:  # transformers reports the last hidden state after the final norm
            leaving = model.apply_final_norm(leaving)
        assert max_diff(leaving, out.hidden_states[layer + 1]) < TOLERANCE, (name, layer)


def test_quantised_file_matches_the_dequantised_transformers_model(converted, tmp_path):
    name, source, _ = converted
    quant = RECIPES[name].quant
    model = wb.load_model(write(name, source, tmp_path / f"{name}-{quant.name}.gguf", quant=quant), attn_impl="sdpa")
    with torch.no_grad():
        expected = quantised_reference(name, source, quant)(TOKENS).logits
        assert max_diff(model(TOKENS), expected) < TOLERANCE, (name, quant.name)
        assert max_diff(expected, source(TOKENS).logits) > 10 * TOLERANCE, "the file should really be quantised"


@pytest.mark.parametrize("quant", [Q.F16, Q.BF16])
def test_half_precision_files_load(tmp_path, quant):
    source = build("qwen2")
    model = wb.load_model(write("qwen2", source, tmp_path / "half.gguf", quant=quant))
    with torch.no_grad():
        assert max_diff(model(TOKENS), quantised_reference("qwen2", source, quant)(TOKENS).logits) < TOLERANCE
