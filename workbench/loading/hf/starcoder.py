"""The StarCoder families in HF format: ``GPTBigCodeForCausalLM`` (SantaCoder, StarCoder, StarCoderBase,
WizardCoder) and ``Starcoder2ForCausalLM`` (StarCoder2), read off transformers 5.24's
``modeling_gpt_bigcode.py`` and ``modeling_starcoder2.py``.

Legend: H n_heads, G n_key_value_heads, K d_head, D d_model, M d_mlp, V d_vocab.

GPT-BigCode is GPT-2 with multi-query attention: learned positions, LayerNorm, biased ``nn.Linear``
maps (not GPT-2's transposed Conv1D). ``c_attn`` fuses Q, K and V: with ``multi_query`` its rows
are all query heads, then the one key head, then the one value head; without it they are laid out
per head as [H, 3, K]. Both are ``parts.split_grouped_qkv``'s grouped layout (G = 1 and G = H).
``scale_attn_weights`` false leaves q.k unscaled. The fp32 softmax switches only change rounding.

StarCoder2 is a pre-norm LayerNorm decoder with RoPE (halves, the whole head), grouped-query
attention, one sliding window on every layer when ``sliding_window`` is set, a plain GELU MLP
(``c_fc``/``c_proj``) and biases on every linear map when ``use_bias``.

    GPT-BigCode (transformer.)                       StarCoder2 (model.)
    wte.weight, wpe.weight -> embed.W_E, pos_embed.W_pos    embed_tokens.weight -> embed.W_E
    h.{l}.ln_1 / ln_2      -> blocks.{l}.ln1 / ln2           layers.{l}.input_layernorm / post_attention_layernorm
    h.{l}.attn.c_attn      -> blocks.{l}.attn._W_{Q,K,V}_lin layers.{l}.self_attn.{q,k,v}_proj
    h.{l}.attn.c_proj      -> blocks.{l}.attn._W_O_lin       layers.{l}.self_attn.o_proj
    h.{l}.mlp.c_fc / c_proj -> blocks.{l}.mlp._W_in_lin / _W_out_lin   layers.{l}.mlp.c_fc / c_proj
    ln_f -> ln_final                                          norm -> ln_final
    lm_head.weight -> unembed._W_U_lin (absent when tied)     (the same)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig
from workbench.loading.hf.parts import fused_qkv, layer_norm, linear, plain_mlp


def model_config(hf: HFConfig, architecture: str) -> ModelConfig:
    """Maps a GPT-BigCode or StarCoder2 ``config.json`` onto ``ModelConfig``; a value we cannot honour
    names its field.

    Example:
        >>> hf = HFConfig({"n_embd": 48, "n_head": 6, "n_layer": 2, "vocab_size": 101, "n_positions": 64},
        ...               "config.json")
        >>> cfg = model_config(hf, "GPTBigCodeForCausalLM")
        >>> cfg.n_key_value_heads, cfg.act_fn, cfg.positional
        (1, 'gelu_new', 'learned')
    """
    return hf.model_config(**_CONFIGS[architecture](hf))


# transformers' GPTBigCodeConfig defaults for fields a config.json may leave out.
_BIGCODE_DEFAULTS = {"activation_function": "gelu_pytorch_tanh", "multi_query": True, "scale_attn_weights": True,
                     "n_positions": 1024, "tie_word_embeddings": True}


def _bigcode_fields(hf: HFConfig) -> dict:
    hf = HFConfig({**_BIGCODE_DEFAULTS, **hf.data}, hf.source)
    if hf.get("add_cross_attention", False):
        raise hf.refuse("add_cross_attention", True, "only decoder-only models load (no cross-attention)")
    d_model, n_heads = int(hf.require("n_embd")), int(hf.require("n_head"))
    return dict(
        n_layers=int(hf.require("n_layer")), d_model=d_model, n_heads=n_heads,
        n_key_value_heads=1 if hf.get("multi_query") else n_heads,
        d_mlp=int(hf.get("n_inner", 4 * d_model)), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.get("n_positions")), normalization="LN",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), positional="learned",
        attn_scale=None if hf.get("scale_attn_weights") else 1.0,
        act_fn=hf.activation("activation_function"), attn_bias=True, mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings")),
    )


# transformers' Starcoder2Config defaults for fields a config.json may leave out.
_STARCODER2_DEFAULTS = {"hidden_act": "gelu_pytorch_tanh", "use_bias": True, "norm_epsilon": 1e-5,
                        "tie_word_embeddings": True}


def _starcoder2_fields(hf: HFConfig) -> dict:
    hf = HFConfig({**_STARCODER2_DEFAULTS, **hf.data}, hf.source)
    d_model, n_heads = int(hf.require("hidden_size")), int(hf.require("num_attention_heads"))
    n_layers, head_dim = int(hf.require("num_hidden_layers")), d_model // n_heads
    layers = HFConfig({k: v for k, v in hf.data.items() if k not in ("layer_types", "no_rope_layers")},
                      hf.source).attention_layers(n_layers, head_dim)
    if layers["rotary_dim"] != head_dim:
        raise hf.refuse("partial_rotary_factor", layers["rotary_dim"] / head_dim,
                        "transformers' StarCoder2 applies RoPE to the whole head")
    bias = bool(hf.get("use_bias"))
    return dict(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads,
        n_key_value_heads=int(hf.get("num_key_value_heads", n_heads)),
        d_mlp=int(hf.require("intermediate_size")), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.require("max_position_embeddings")), normalization="LN",
        norm_eps=float(hf.get("norm_epsilon")), act_fn=hf.activation("hidden_act"),
        attn_bias=bias, mlp_bias=bias, tie_embeddings=bool(hf.get("tie_word_embeddings")), **layers,
    )


_CONFIGS: dict[str, Callable[[HFConfig], dict]] = {
    "GPTBigCodeForCausalLM": _bigcode_fields,
    "Starcoder2ForCausalLM": _starcoder2_fields,
}


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str) -> dict[str, Tensor]:
    """Reads every tensor the model needs under our names (GPT-BigCode's fused ``c_attn`` split); a
    missing or mis-shaped one is a ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-santacoder")), cfg,
        ...                           "GPTBigCodeForCausalLM")                           # doctest: +SKIP
        >>> tensors["blocks.0.attn._W_K_lin"].shape   # one key head                     # doctest: +SKIP
        torch.Size([8, 48])
    """
    layout = LAYOUTS[architecture]
    V, D, M = cfg.d_vocab, cfg.d_model, cfg.d_mlp
    out = {"embed.W_E": ckpt.take(f"{layout.embed}.weight", (V, D)),
           **layer_norm(ckpt, layout.final_norm, "ln_final", D)}
    if layout.pos_embed is not None:
        out["pos_embed.W_pos"] = ckpt.take(f"{layout.pos_embed}.weight", (cfg.n_ctx, D))
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    for layer in range(cfg.n_layers):
        hf, ours = layout.layer.format(l=layer), f"blocks.{layer}"
        out.update(layer_norm(ckpt, f"{hf}.{layout.ln1}", f"{ours}.ln1", D))
        out.update(layer_norm(ckpt, f"{hf}.{layout.ln2}", f"{ours}.ln2", D))
        out.update(layout.qkv(ckpt, cfg, hf, f"{ours}.attn"))
        out.update(linear(ckpt, f"{hf}.{layout.out}", f"{ours}.attn._W_O_lin", (D, D),
                          f"{ours}.attn.b_O" if cfg.attn_bias else None))
        out.update(plain_mlp(ckpt, f"{hf}.mlp.c_fc", f"{hf}.mlp.c_proj", f"{ours}.mlp", D, M, cfg.mlp_bias))
    return out


def _bigcode_qkv(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, hf: str, ours: str) -> dict[str, Tensor]:
    return fused_qkv(ckpt, f"{hf}.attn.c_attn", ours, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head,
                     cfg.d_model, bias=True)


def _starcoder2_qkv(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, hf: str, ours: str) -> dict[str, Tensor]:
    out = {}
    for name, heads in (("Q", cfg.n_heads), ("K", cfg.n_key_value_heads), ("V", cfg.n_key_value_heads)):
        out.update(linear(ckpt, f"{hf}.self_attn.{name.lower()}_proj", f"{ours}._W_{name}_lin",
                          (heads * cfg.d_head, cfg.d_model), f"{ours}._b_{name}_lin" if cfg.attn_bias else None))
    return out


@dataclass(frozen=True)
class Layout:
    """Where one architecture keeps its tensors; ``{l}`` in ``layer`` is the layer index."""

    embed: str
    final_norm: str
    pos_embed: Optional[str]  # None: RoPE
    layer: str
    ln1: str
    ln2: str
    out: str
    qkv: Callable[[SafetensorsCheckpoint, ModelConfig, str, str], dict[str, Tensor]]


LAYOUTS = {
    "GPTBigCodeForCausalLM": Layout(embed="transformer.wte", final_norm="transformer.ln_f",
                                    pos_embed="transformer.wpe", layer="transformer.h.{l}", ln1="ln_1", ln2="ln_2",
                                    out="attn.c_proj", qkv=_bigcode_qkv),
    "Starcoder2ForCausalLM": Layout(embed="model.embed_tokens", final_norm="model.norm", pos_embed=None,
                                    layer="model.layers.{l}", ln1="input_layernorm", ln2="post_attention_layernorm",
                                    out="self_attn.o_proj", qkv=_starcoder2_qkv),
}


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={
        "GPTBigCodeForCausalLM": ("gpt_bigcode", "StarCoder, StarCoderBase, SantaCoder (multi-query attention)"),
        "Starcoder2ForCausalLM": ("starcoder2", "StarCoder2"),
    },
    model_config=model_config,
    convert_tensors=convert_tensors,
    # GPT-BigCode's saved causal-mask buffer is not a parameter.
    ignored_tensors=re.compile(r"transformer\.bias"),
),)
