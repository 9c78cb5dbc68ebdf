"""Tiny random models built by `transformers` itself, saved as HF directories, for parity tests.

Odd sizes on purpose: 6 query heads over 2 KV heads (GQA groups of 3), d_head 8, d_mlp 80, a
101-token vocabulary. Weights are re-drawn with a large spread (and norm gains and biases away
from their 1/0 defaults), so attention is peaked: an off-by-one mask, a swapped Q/K layout or
a dropped bias changes the logits by far more than the 1e-4 tolerance.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM)

VOCAB = 101
N_CTX = 64
SLIDING_WINDOW = 5
_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                   num_hidden_layers=2, intermediate_size=80, max_position_embeddings=N_CTX)

FACTORIES = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=48, n_head=6, n_layer=2, n_positions=N_CTX,
                                               bos_token_id=1, eos_token_id=2)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_LLAMA_LIKE, rms_norm_eps=1e-5, rope_theta=500.0)),
    "llama_biased": lambda: LlamaForCausalLM(LlamaConfig(**_LLAMA_LIKE, attention_bias=True, mlp_bias=True,
                                                         head_dim=12)),  # d_head * n_heads != d_model
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_LLAMA_LIKE, sliding_window=SLIDING_WINDOW)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_LLAMA_LIKE, tie_word_embeddings=True)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**_LLAMA_LIKE, num_local_experts=8, num_experts_per_tok=2)),
}


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 1, std: float = 0.15) -> torch.nn.Module:
    """Every parameter re-drawn: gains ~ 1 + N(0, 0.1), everything else (biases included) ~ N(0, std).
    Floating-point buffers the checkpoint saves (DeepSeek-V3's e_score_correction_bias) are re-drawn too."""
    generator = torch.Generator().manual_seed(seed)
    saved = set(model.state_dict())
    buffers = [(name, b) for name, b in model.named_buffers() if name in saved and b.is_floating_point()]
    for name, param in [*model.named_parameters(), *buffers]:
        noise = torch.randn(param.shape, generator=generator)
        is_gain = param.ndim == 1 and ("norm" in name or ".ln_" in name) and name.endswith("weight")
        param.copy_(1 + 0.1 * noise if is_gain else std * noise)
    return model


def word_tokenizer(add_bos_token: bool = True) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over the words "t0".."t100" (BOS "t1", EOS "t2")."""
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", bos_token="t1", eos_token="t2",
                                   pad_token="t2", add_bos_token=add_bos_token)


def build_and_save(name: str, directory: Path, seed: int = 1):
    """A randomised eager-attention HF model of architecture ``name``, saved (with a tokenizer) to ``directory``."""
    torch.manual_seed(seed)
    model = randomize(FACTORIES[name](), seed=seed).eval()
    model.set_attn_implementation("eager")  # the reference path: scores materialised, no fused kernel
    model.save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    return model
