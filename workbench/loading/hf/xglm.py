"""XGLM in HF format (``XGLMForCausalLM``: facebook/xglm-564M ... 7.5B), read off transformers 5.24's
``modeling_xglm.py``.

Legend: D d_model, M d_mlp, V d_vocab.

XGLM is fairseq's pre-norm decoder: token embeddings times sqrt(D) (``scale_embedding``), fixed
sinusoidal positions in fairseq's layout (``sinusoidal_style="fairseq"``: all sines then all
cosines, read at position + 2), biased multi-head attention, a biased ``fc1``/``fc2`` MLP, a final
LayerNorm and a tied, bias-free unembedding.

transformers zeroes the table's row ``pad_token_id`` while reading position p at row p + 2 whatever
the padding index is, so with ``pad_token_id`` >= 2 a real position reads a zeroed row (fairseq itself
starts positions after the padding index): refused, naming the field. XGLM's own checkpoints pad
with 1, a row no position reads.

    model.embed_tokens.weight                         -> embed.W_E
    model.layers.{l}.self_attn_layer_norm / final_layer_norm -> blocks.{l}.ln1 / ln2
    model.layers.{l}.self_attn.{q,k,v,out}_proj       -> blocks.{l}.attn._W_{Q,K,V,O}_lin (+ biases)
    model.layers.{l}.fc1 / fc2                        -> blocks.{l}.mlp._W_in_lin / _W_out_lin (+ b_in / b_out)
    model.layer_norm -> ln_final;  lm_head.weight -> unembed._W_U_lin (absent when tied)
"""

from __future__ import annotations

import math

from torch import Tensor

from workbench.components.embedding import FAIRSEQ_POSITION_OFFSET
from workbench.config import ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig
from workbench.loading.hf.parts import layer_norm, linear, plain_mlp


# transformers' XGLMConfig defaults for fields a config.json may leave out.
_DEFAULTS = {"activation_function": "gelu", "scale_embedding": True, "tie_word_embeddings": True}


def model_config(hf: HFConfig, architecture: str = "XGLMForCausalLM") -> ModelConfig:
    """Maps an XGLM ``config.json`` onto ``ModelConfig``; a value we cannot honour names its field.

    Example:
        >>> hf = HFConfig({"d_model": 48, "attention_heads": 6, "num_layers": 2, "ffn_dim": 80,
        ...                "vocab_size": 101, "max_position_embeddings": 64, "pad_token_id": 1}, "config.json")
        >>> cfg = model_config(hf)
        >>> cfg.positional, cfg.sinusoidal_style, round(cfg.embed_scale, 3)
        ('sinusoidal', 'fairseq', 6.928)
    """
    hf = HFConfig({**_DEFAULTS, **hf.data}, hf.source)
    if hf.get("add_cross_attention", False):
        raise hf.refuse("add_cross_attention", True, "only decoder-only models load (no cross-attention)")
    pad = hf.get("pad_token_id")
    if pad is not None and int(pad) >= FAIRSEQ_POSITION_OFFSET:
        raise hf.refuse("pad_token_id", pad, "transformers' XGLM zeroes that row of its position table, which a real "
                        f"position then reads (positions start at row {FAIRSEQ_POSITION_OFFSET})")
    d_model = int(hf.require("d_model"))
    return hf.model_config(
        n_layers=int(hf.require("num_layers")), d_model=d_model, n_heads=int(hf.require("attention_heads")),
        d_mlp=int(hf.require("ffn_dim")), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.require("max_position_embeddings")), normalization="LN", norm_eps=1e-5,  # nn.LayerNorm's
        positional="sinusoidal", sinusoidal_style="fairseq",
        embed_scale=math.sqrt(d_model) if hf.get("scale_embedding") else 1.0,
        act_fn=hf.activation("activation_function"), attn_bias=True, mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings")),
    )


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str = "") -> dict[str, Tensor]:
    """Reads every tensor the model needs under our names; a missing or mis-shaped one is a
    ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-xglm")), cfg)   # doctest: +SKIP
        >>> "pos_embed.W_pos" in tensors   # the sinusoidal table is no weight            # doctest: +SKIP
        False
    """
    V, D, M = cfg.d_vocab, cfg.d_model, cfg.d_mlp
    out = {"embed.W_E": ckpt.take("model.embed_tokens.weight", (V, D)),
           **layer_norm(ckpt, "model.layer_norm", "ln_final", D)}
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    for layer in range(cfg.n_layers):
        hf, ours = f"model.layers.{layer}", f"blocks.{layer}"
        out.update(layer_norm(ckpt, f"{hf}.self_attn_layer_norm", f"{ours}.ln1", D))
        out.update(layer_norm(ckpt, f"{hf}.final_layer_norm", f"{ours}.ln2", D))
        for proj, name, bias in (("q", "Q", "_b_Q_lin"), ("k", "K", "_b_K_lin"), ("v", "V", "_b_V_lin"),
                                 ("out", "O", "b_O")):
            out.update(linear(ckpt, f"{hf}.self_attn.{proj}_proj", f"{ours}.attn._W_{name}_lin", (D, D),
                              f"{ours}.attn.{bias}"))
        out.update(plain_mlp(ckpt, f"{hf}.fc1", f"{hf}.fc2", f"{ours}.mlp", D, M, bias=True))
    return out


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={"XGLMForCausalLM": ("xglm", "XGLM (fairseq's sinusoidal positions)")},
    model_config=model_config,
    convert_tensors=convert_tensors,
),)
