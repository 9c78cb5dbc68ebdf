"""A tiny llama GGUF written the way llama.cpp's converter writes one, from a `transformers` model.

Q and K rows are permuted per head exactly as ``convert_hf_to_gguf.py`` (``LlamaModel.permute``)
does, matrices are quantised with the `gguf` package's own quantisers (Q8_0 / Q4_1 / F16),
norms stay F32, and the vocabulary is a real byte-level BPE: the 256 byte symbols plus a few
merges. So loading it exercises the same un-permutation, dequantisation and tokenizer rebuild
as a real file, at a size that loads in a fraction of a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from workbench.loading.gguf.tokenizer import bytes_to_unicode

D_MODEL, N_HEADS, N_KV, D_MLP, N_LAYERS = 64, 4, 2, 96, 2
MERGES = ["Ġ t", "h e", "Ġt he", "i n"]
SPECIALS = ["<|endoftext|>", "<|im_start|>"]
# A sentencepiece-style ("llama") vocabulary: unk/bos/eos, 256 byte-fallback tokens, scored pieces.
SP_PIECES = ["▁", "t", "h", "e", "i", "n", "a", "▁t", "he", "▁the", "in", "▁in", "▁a", "an", "▁an", "d", "▁and", "x", "é"]


def vocabulary(kind: str = "gpt2") -> list[str]:
    """gpt2: two control tokens, the 256 byte symbols, one token per merge. llama: see SP_PIECES."""
    if kind == "llama":
        return ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SP_PIECES
    return SPECIALS + list(bytes_to_unicode().values()) + ["".join(m.split(" ")) for m in MERGES]


def _write_tokenizer(writer: gguf.GGUFWriter, kind: str) -> None:
    tokens = vocabulary(kind)
    writer.add_token_list(tokens)
    if kind == "llama":  # no merges: they are implied by the scores (unk 2, control 3, byte 6, normal 1)
        writer.add_tokenizer_model("llama")
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SP_PIECES))
        writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SP_PIECES))])
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        return
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)


def tiny_llama(seed: int = 0, n_experts: int = 0, kind: str = "gpt2"):
    """A random Llama (or, with ``n_experts``, a Mixtral with top-2 routing) with tied embeddings,
    sized for the ``kind`` vocabulary."""
    torch.manual_seed(seed)
    sizes = dict(vocab_size=len(vocabulary(kind)), hidden_size=D_MODEL, num_attention_heads=N_HEADS,
                 num_key_value_heads=N_KV, num_hidden_layers=N_LAYERS, intermediate_size=D_MLP,
                 max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=0)
    if n_experts:
        model = MixtralForCausalLM(MixtralConfig(**sizes, num_local_experts=n_experts, num_experts_per_tok=2))
    else:
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if name.endswith("norm.weight") else 0.2 * torch.randn_like(param))
    return model.eval()


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: LlamaForCausalLM, path: Path, quant: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
               extra_fields: Optional[dict] = None, skip_tensor: Optional[str] = None, kind: str = "gpt2") -> Path:
    """Writes ``model`` as a llama GGUF with a ``kind`` tokenizer; ``skip_tensor`` leaves one out (for error tests)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(D_MODEL)
    writer.add_feed_forward_length(D_MLP)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(D_MODEL // N_HEADS)
    _write_tokenizer(writer, kind)
    n_experts = getattr(model.config, "num_local_experts", 0)
    if n_experts:
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(model.config.num_experts_per_tok)
    for key, value in (extra_fields or {}).items():
        writer.add_string(key, value)

    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for layer in range(N_LAYERS):
        hf = f"model.layers.{layer}"
        names.update({f"blk.{layer}.attn_norm.weight": f"{hf}.input_layernorm.weight",
                      f"blk.{layer}.ffn_norm.weight": f"{hf}.post_attention_layernorm.weight",
                      f"blk.{layer}.attn_q.weight": f"{hf}.self_attn.q_proj.weight",
                      f"blk.{layer}.attn_k.weight": f"{hf}.self_attn.k_proj.weight",
                      f"blk.{layer}.attn_v.weight": f"{hf}.self_attn.v_proj.weight",
                      f"blk.{layer}.attn_output.weight": f"{hf}.self_attn.o_proj.weight"})
        if n_experts:  # llama.cpp stacks Mixtral's experts: gate (w1), up (w3) [E, M, D]; down (w2) [E, D, M]
            gate_up = state.pop(f"{hf}.mlp.experts.gate_up_proj")
            state[f"{hf}.gate"], state[f"{hf}.up"] = gate_up[:, :D_MLP], gate_up[:, D_MLP:]
            names.update({f"blk.{layer}.ffn_gate_inp.weight": f"{hf}.mlp.gate.weight",
                          f"blk.{layer}.ffn_gate_exps.weight": f"{hf}.gate",
                          f"blk.{layer}.ffn_up_exps.weight": f"{hf}.up",
                          f"blk.{layer}.ffn_down_exps.weight": f"{hf}.mlp.experts.down_proj"})
        else:
            names.update({f"blk.{layer}.ffn_gate.weight": f"{hf}.mlp.gate_proj.weight",
                          f"blk.{layer}.ffn_up.weight": f"{hf}.mlp.up_proj.weight",
                          f"blk.{layer}.ffn_down.weight": f"{hf}.mlp.down_proj.weight"})
    for gguf_name, hf_name in names.items():
        if gguf_name == skip_tensor:
            continue
        array = np.ascontiguousarray(state[hf_name])
        if gguf_name.endswith("attn_q.weight"):
            array = _llama_cpp_permute(array, N_HEADS)
        elif gguf_name.endswith("attn_k.weight"):
            array = _llama_cpp_permute(array, N_KV)
        if array.ndim == 1:
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, quant), raw_dtype=quant)  # shape from the bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
