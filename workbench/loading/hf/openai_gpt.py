"""OpenAI GPT (GPT-1) in HF format (``OpenAIGPTLMHeadModel``), read off transformers 5.24's
``modeling_openai.py``.

Legend: D d_model, M d_mlp, V d_vocab.

The original transformer decoder: learned positions, post-norm blocks (``ln_1(x + attn(x))``, then
``ln_2(n + mlp(n))``) and so no final norm, biased multi-head attention and MLP in GPT-2's transposed
``Conv1D`` layout, a tied bias-free unembedding. ``afn`` "gelu" is the tanh approximation
(transformers' ``ACT_FNS`` maps it to ``gelu_new``). Its causal mask puts -1e4 on future keys rather
than -inf, which leaves no weight on them either (e^-1e4 is 0 in every float format).

    transformer.tokens_embed.weight / positions_embed.weight -> embed.W_E / pos_embed.W_pos
    transformer.h.{l}.attn.c_attn [D, 3D] (in, out)   -> blocks.{l}.attn._W_{Q,K,V}_lin (transposed; + biases)
    transformer.h.{l}.attn.c_proj                     -> blocks.{l}.attn._W_O_lin (+ b_O)
    transformer.h.{l}.ln_1 / ln_2                     -> blocks.{l}.ln1 / ln2
    transformer.h.{l}.mlp.c_fc / c_proj               -> blocks.{l}.mlp._W_in_lin / _W_out_lin (+ b_in / b_out)
    lm_head.weight -> unembed._W_U_lin (absent when tied)
"""

from __future__ import annotations

import re

from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig
from workbench.loading.hf.parts import layer_norm

# transformers' ACT_FNS for OpenAI GPT -> ours ("gelu" there is the tanh approximation).
ACTIVATIONS = {"gelu": "gelu_new", "relu": "relu", "silu": "silu", "swish": "silu"}


def model_config(hf: HFConfig, architecture: str = "OpenAIGPTLMHeadModel") -> ModelConfig:
    """Maps an OpenAI GPT ``config.json`` onto ``ModelConfig``; a value we cannot honour names its field.

    Example:
        >>> hf = HFConfig({"n_embd": 48, "n_head": 6, "n_layer": 2, "vocab_size": 101, "n_positions": 64},
        ...               "config.json")
        >>> cfg = model_config(hf)
        >>> cfg.norm_placement, cfg.has_final_norm, cfg.act_fn
        ('post', False, 'gelu_new')
    """
    afn = hf.get("afn", "gelu")
    if afn not in ACTIVATIONS:
        raise hf.refuse("afn", afn, f"supported activations are {sorted(ACTIVATIONS)}")
    d_model = int(hf.require("n_embd"))
    return hf.model_config(
        n_layers=int(hf.require("n_layer")), d_model=d_model, n_heads=int(hf.require("n_head")),
        d_mlp=4 * d_model, d_vocab=int(hf.require("vocab_size")), n_ctx=int(hf.get("n_positions", 512)),
        normalization="LN", norm_placement="post", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        positional="learned", act_fn=ACTIVATIONS[afn], attn_bias=True, mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str = "") -> dict[str, Tensor]:
    """Reads every tensor the model needs, transposed from ``Conv1D`` and split into our layout; a
    missing or mis-shaped one is a ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-gpt1")), cfg)   # doctest: +SKIP
        >>> "ln_final.w" in tensors   # post-norm: no final norm                       # doctest: +SKIP
        False
    """
    V, D, M = cfg.d_vocab, cfg.d_model, cfg.d_mlp
    # The hub's openai-gpt checkpoint stores the base model's names, without "transformer.".
    prefix = "transformer." if ckpt.has("transformer.tokens_embed.weight") else ""
    out = {"embed.W_E": ckpt.take(f"{prefix}tokens_embed.weight", (V, D)),
           "pos_embed.W_pos": ckpt.take(f"{prefix}positions_embed.weight", (cfg.n_ctx, D))}
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    for layer in range(cfg.n_layers):
        hf, ours = f"{prefix}h.{layer}", f"blocks.{layer}"
        out.update(layer_norm(ckpt, f"{hf}.ln_1", f"{ours}.ln1", D))
        out.update(layer_norm(ckpt, f"{hf}.ln_2", f"{ours}.ln2", D))
        qkv_3DD = ckpt.take(f"{hf}.attn.c_attn.weight", (D, 3 * D)).T  # Conv1D [in, out] -> Linear [out, in]
        qkv_3D = ckpt.take(f"{hf}.attn.c_attn.bias", (3 * D,))
        for index, name in enumerate("QKV"):
            out[f"{ours}.attn._W_{name}_lin"] = qkv_3DD[index * D:(index + 1) * D]
            out[f"{ours}.attn._b_{name}_lin"] = qkv_3D[index * D:(index + 1) * D]
        for hf_name, weight, bias, shape in (("attn.c_proj", "attn._W_O_lin", "attn.b_O", (D, D)),
                                             ("mlp.c_fc", "mlp._W_in_lin", "mlp.b_in", (D, M)),
                                             ("mlp.c_proj", "mlp._W_out_lin", "mlp.b_out", (M, D))):
            out[f"{ours}.{weight}"] = ckpt.take(f"{hf}.{hf_name}.weight", shape).T
            out[f"{ours}.{bias}"] = ckpt.take(f"{hf}.{hf_name}.bias", shape[1:])
    return out


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={"OpenAIGPTLMHeadModel": ("openai-gpt", "OpenAI GPT (GPT-1; post-norm)")},
    model_config=model_config,
    convert_tensors=convert_tensors,
    # Buffers older checkpoints saved that are not parameters: the causal mask and the position ids.
    ignored_tensors=re.compile(r"(transformer\.)?(h\.\d+\.attn\.bias|position_ids)"),
),)
