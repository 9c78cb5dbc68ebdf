"""SmolLM2-135M's GGUF through the weights cache: the second load reads the entry the first wrote (nothing
dequantised) and is the same model, bit for bit: logits, and token ids of text that exercises the byte-level
vocabulary, special tokens and whitespace runs."""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.loading.gguf import loader as gguf_loader

pytestmark = pytest.mark.slow

TEXTS = [
    "The Eiffel Tower is in the city of",
    "Ünïcödé: naïve café, Straße, 東京, Москва, emoji 🤖🎉 and ✓.",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}  # comment\n",
    "tabs\tand   runs    of\n\n\nwhitespace  \t \n  end  ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]


def test_a_cached_smollm2_is_the_converted_one_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    calls = []
    real = gguf_loader.read_tensors
    monkeypatch.setattr(gguf_loader, "read_tensors", lambda *args: calls.append(1) or real(*args))
    try:
        first = wb.load_model("smollm2-135m", progress=False)
    except wb.CheckpointError as error:
        pytest.skip(f"SmolLM2 is not installed: {error}")
    second = wb.load_model("smollm2-135m", progress=False)
    assert len(calls) == 1 and len(list((tmp_path / "weights").iterdir())) == 1
    assert second.cfg == first.cfg
    for text in TEXTS:
        assert second.tokenizer.encode(text) == first.tokenizer.encode(text), text
    tokens = first.to_tokens(TEXTS[0])
    with torch.no_grad():
        assert torch.equal(second(tokens), first(tokens))
