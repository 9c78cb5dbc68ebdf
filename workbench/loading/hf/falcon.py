"""Falcon in HF format (``FalconForCausalLM``): both decoder layouts, read off transformers 5.24's
``modeling_falcon.py``.

Legend: H n_heads, G n_key_value_heads, K d_head, D d_model, M d_mlp, V d_vocab.

Falcon is a LayerNorm decoder with RoPE (over halves of the whole head), a plain MLP and optional
biases (``bias``, on every linear map). Its two layouts differ only in config values:

- the old one (``new_decoder_architecture`` false; Falcon-7B, and Falcon-RW but for its ALiBi): multi-query attention
  (``multi_query``: one key/value head) or multi-head attention; with ``parallel_attn`` (the default)
  attention and MLP both read ONE norm of the block input (``input_layernorm``, loaded as two clones,
  ln1 and ln2, so each can be edited alone); without it a sequential pre-norm block
  (``input_layernorm``, ``post_attention_layernorm``);
- the new one (Falcon-40B/180B; Falcon2-11B): grouped-query attention over ``num_kv_heads`` and always
  parallel, with two norms of the block input (``ln_attn`` for attention, ``ln_mlp`` for the MLP) or
  one (``num_ln_in_parallel_attn`` 1, Falcon2-11B).

Q, K and V are fused in ``query_key_value``, whose output rows come in key/value groups: each group
holds its query heads, then its key head, then its value head ([G, H/G + 2, K]). All three
layouts are that one shape: the new one directly, the old multi-query one with G = 1 ([H + 2, K]) and
the old multi-head one with G = H ([H, 3, K]). ``parts.split_grouped_qkv`` reads them all.

Refused: ``alibi`` true, because transformers 5.24 itself has no one answer to be at parity with: its
eager attention adds the ALiBi bias twice (once in the mask it builds, once in the attention) and
its SDPA path once, both rounded to bfloat16 (the two disagree by tenths of a logit on a tiny model);
the new layout without ``parallel_attn`` (transformers' block reads norms it never built); a RoPE
over part of the head (transformers' Falcon rotates the whole head).

    transformer.word_embeddings.weight                -> embed.W_E
    transformer.h.{l}.input_layernorm                 -> blocks.{l}.ln1 (and ln2 when parallel)
    transformer.h.{l}.post_attention_layernorm        -> blocks.{l}.ln2 (sequential blocks)
    transformer.h.{l}.ln_attn / ln_mlp                -> blocks.{l}.ln1 / ln2 (new layout, two norms)
    transformer.h.{l}.self_attention.query_key_value  -> blocks.{l}.attn._W_{Q,K,V}_lin (+ biases)
    transformer.h.{l}.self_attention.dense            -> blocks.{l}.attn._W_O_lin (+ b_O)
    transformer.h.{l}.mlp.dense_h_to_4h / dense_4h_to_h -> blocks.{l}.mlp._W_in_lin / _W_out_lin (+ b_in / b_out)
    transformer.ln_f -> ln_final;  lm_head.weight -> unembed._W_U_lin (absent when tied)
"""

from __future__ import annotations

from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig
from workbench.loading.hf.parts import fused_qkv, layer_norm, linear, plain_mlp, shared_layer_norm


# transformers' FalconConfig defaults for fields a config.json may leave out.
_DEFAULTS = {"activation": "gelu", "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
             "bias": False, "tie_word_embeddings": True}


def model_config(hf: HFConfig, architecture: str = "FalconForCausalLM") -> ModelConfig:
    """Maps a Falcon ``config.json`` onto ``ModelConfig``; a value we cannot honour names its field.

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "num_attention_heads": 6, "num_hidden_layers": 2,
        ...                "vocab_size": 101, "new_decoder_architecture": True, "num_kv_heads": 2}, "config.json")
        >>> cfg = model_config(hf)
        >>> cfg.n_key_value_heads, cfg.parallel_attn_mlp, cfg.d_mlp
        (2, True, 192)
    """
    hf = HFConfig({**_DEFAULTS, **hf.data}, hf.source)
    if hf.get("alibi", False):
        raise hf.refuse("alibi", True, "transformers 5.24's Falcon adds the ALiBi bias twice under eager attention "
                        "and once under SDPA (both rounded to bfloat16), so there is no reference to be at parity with")
    new_layout, parallel = bool(hf.get("new_decoder_architecture")), bool(hf.get("parallel_attn"))
    if new_layout and not parallel:
        raise hf.refuse("parallel_attn", False, "transformers' new Falcon decoder layout is parallel only "
                        "(its sequential block reads norms it never builds)")
    d_model = int(hf.require("hidden_size"))
    n_heads = int(hf.require("num_attention_heads"))
    rotary = hf.rotary(d_model // n_heads)
    if rotary["rotary_dim"] != d_model // n_heads:
        raise hf.refuse("partial_rotary_factor", rotary["rotary_dim"] / (d_model // n_heads),
                        "transformers' Falcon applies RoPE to the whole head")
    bias = bool(hf.get("bias"))
    return hf.model_config(
        n_layers=int(hf.require("num_hidden_layers")), d_model=d_model, n_heads=n_heads,
        n_key_value_heads=_kv_heads(hf, n_heads, new_layout),
        d_mlp=int(hf.get("ffn_hidden_size", 4 * d_model)), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.get("max_position_embeddings", 2048)), normalization="LN",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        act_fn=hf.activation("activation"),
        parallel_attn_mlp=parallel, attn_bias=bias, mlp_bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings")), **rotary,
    )


def _kv_heads(hf: HFConfig, n_heads: int, new_layout: bool) -> int:
    """Key/value heads as transformers' ``FalconAttention`` splits them: ``num_kv_heads`` in the new
    layout, one with ``multi_query``, else one per query head (the [H, 3, K] layout)."""
    if new_layout:
        return int(hf.get("num_kv_heads", n_heads))
    if hf.get("multi_query"):
        return 1
    if int(hf.get("num_kv_heads", n_heads)) != n_heads:
        raise hf.refuse("num_kv_heads", hf.get("num_kv_heads"), "the old layout without multi_query has one "
                        "key/value head per query head (transformers cannot run fewer)")
    return n_heads


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str = "") -> dict[str, Tensor]:
    """Reads every tensor the model needs under our names, the fused QKV split per key/value group;
    a missing or mis-shaped one is a ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-falcon")), cfg)   # doctest: +SKIP
        >>> tensors["blocks.0.attn._W_K_lin"].shape   # [G*K, D]                         # doctest: +SKIP
        torch.Size([16, 48])
    """
    V, D = cfg.d_vocab, cfg.d_model
    out = {"embed.W_E": ckpt.take("transformer.word_embeddings.weight", (V, D)),
           **layer_norm(ckpt, "transformer.ln_f", "ln_final", D)}
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    for layer in range(cfg.n_layers):
        hf, ours = f"transformer.h.{layer}", f"blocks.{layer}"
        out.update(_norms(ckpt, cfg, hf, ours))
        out.update(_attention(ckpt, cfg, f"{hf}.self_attention", f"{ours}.attn"))
        out.update(plain_mlp(ckpt, f"{hf}.mlp.dense_h_to_4h", f"{hf}.mlp.dense_4h_to_h", f"{ours}.mlp", D,
                             cfg.d_mlp, cfg.mlp_bias))
    return out


def _norms(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, hf: str, ours: str) -> dict[str, Tensor]:
    """ln1 and ln2 from whichever norms this layer has: two of its own, or one shared (two clones)."""
    D = cfg.d_model
    if ckpt.has(f"{hf}.ln_attn.weight"):
        return {**layer_norm(ckpt, f"{hf}.ln_attn", f"{ours}.ln1", D),
                **layer_norm(ckpt, f"{hf}.ln_mlp", f"{ours}.ln2", D)}
    if cfg.parallel_attn_mlp:  # one norm read by attention and MLP alike
        return shared_layer_norm(ckpt, f"{hf}.input_layernorm", ours, D)
    return {**layer_norm(ckpt, f"{hf}.input_layernorm", f"{ours}.ln1", D),
            **layer_norm(ckpt, f"{hf}.post_attention_layernorm", f"{ours}.ln2", D)}


def _attention(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, hf: str, ours: str) -> dict[str, Tensor]:
    out = fused_qkv(ckpt, f"{hf}.query_key_value", ours, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head,
                    cfg.d_model, cfg.attn_bias)
    out.update(linear(ckpt, f"{hf}.dense", f"{ours}._W_O_lin", (cfg.d_model, cfg.n_heads * cfg.d_head),
                      f"{ours}.b_O" if cfg.attn_bias else None))
    return out


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={"FalconForCausalLM": ("falcon", "Falcon-7B (multi-query), Falcon-40B/180B, Falcon2-11B "
                                                   "(grouped-query); the ALiBi variant (Falcon-RW) is refused")},
    model_config=model_config,
    convert_tensors=convert_tensors,
),)
