"""The Llama family in HF format: Llama, Mistral (sliding window), Qwen2 (QKV bias), Mixtral (MoE).

Legend: L n_layers, E num_experts, M d_mlp, D d_model.

All four are pre-norm RMSNorm decoders with RoPE, grouped-query attention and a SwiGLU MLP;
they differ only in config values, which ``Variant`` records, and in Mixtral's expert tensors.
HF tensor names (transformers 5.23 ``save_pretrained``) and ours (the nn.Linear-layout storage,
whose TransformerLens views are ``W_Q``, ``W_in``, ``W_U`` ...):

    model.embed_tokens.weight                  -> embed.W_E
    model.layers.{l}.input_layernorm.weight    -> blocks.{l}.ln1.w   (post_attention_layernorm -> ln2.w)
    model.layers.{l}.self_attn.{q,k,v,o}_proj  -> blocks.{l}.attn._W_{Q,K,V,O}_lin (+ .bias -> _b_{Q,K,V}_lin, b_O)
    model.layers.{l}.mlp.{gate,up,down}_proj   -> blocks.{l}.mlp._W_{gate,in,out}_lin
    model.layers.{l}.block_sparse_moe.gate     -> blocks.{l}.mlp._W_router_lin          (Mixtral)
    ...block_sparse_moe.experts.{e}.w{1,3,2}   -> blocks.{l}.mlp._W_{gate,in,out}_lin[e] (stacked over e)
    model.norm.weight -> ln_final.w;  lm_head.weight -> unembed._W_U_lin (absent when tied)

Mixtral's experts may also come fused, as transformers holds them in memory
(``mlp.experts.gate_up_proj`` [E, 2M, D] with gate rows first, ``mlp.experts.down_proj``
[E, D, M]); both spellings load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.hf_checkpoint import SafetensorsCheckpoint
from workbench.loading.hf_common import HFConfig

# Buffers older checkpoints carry that are not parameters (RoPE's inverse frequencies are recomputed).
# The architectures this module loads: {architecture: (model_type, models)}.
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "Llama 1-3 (RoPE scaling: linear, dynamic, llama3, yarn)"),
    "MistralForCausalLM": ("mistral", "Mistral"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2, Qwen2.5"),
    "MixtralForCausalLM": ("mixtral", "Mixtral"),
}

IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Variant:
    """What distinguishes one member of the family, as data rather than branches on a name."""

    qkv_bias_field: str | None  # config field switching q/k/v (and o) bias on; None: qkv_bias_always
    qkv_bias_always: bool = False  # Qwen2: q/k/v always biased, o_proj never
    honours_sliding_window: bool = False
    moe: bool = False


VARIANTS = {
    "LlamaForCausalLM": Variant(qkv_bias_field="attention_bias"),
    "MistralForCausalLM": Variant(qkv_bias_field=None, honours_sliding_window=True),
    "Qwen2ForCausalLM": Variant(qkv_bias_field=None, qkv_bias_always=True, honours_sliding_window=True),
    "MixtralForCausalLM": Variant(qkv_bias_field=None, honours_sliding_window=True, moe=True),
}


def model_config(hf: HFConfig, architecture: str) -> ModelConfig:
    """Maps a Llama-family ``config.json`` onto ``ModelConfig``; unsupported values name their field.

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2,
        ...                "num_hidden_layers": 2, "intermediate_size": 80, "vocab_size": 101,
        ...                "max_position_embeddings": 64, "hidden_act": "silu"}, "config.json")
        >>> model_config(hf, "LlamaForCausalLM").n_query_groups
        3
    """
    variant = VARIANTS[architecture]
    d_model, n_heads = int(hf.require("hidden_size")), int(hf.require("num_attention_heads"))
    n_layers = int(hf.require("num_hidden_layers"))
    head_dim = int(hf.get("head_dim", d_model // n_heads))
    attn_bias = variant.qkv_bias_always or bool(variant.qkv_bias_field and hf.get(variant.qkv_bias_field, False))
    moe = {}
    if variant.moe:
        moe = dict(num_experts=int(hf.require("num_local_experts")),
                   experts_per_token=int(hf.require("num_experts_per_tok")), router_renormalize=True)
    return hf.model_config(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads,
        n_key_value_heads=int(hf.get("num_key_value_heads", n_heads)), d_head=head_dim,
        d_mlp=int(hf.require("intermediate_size")), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.require("max_position_embeddings")),
        normalization="RMS", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), act_fn=hf.activation("hidden_act"),
        gated_mlp=True, attn_bias=attn_bias, mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **_attention_layers(hf, variant, n_layers, head_dim), **moe,
    )


def _attention_layers(hf: HFConfig, variant: Variant, n_layers: int, head_dim: int) -> dict:
    """Sliding windows and RoPE per layer (``HFConfig.attention_layers``); a window on a Llama is refused."""
    window = hf.get("sliding_window")
    if window is not None and not variant.honours_sliding_window and hf.get("layer_types") is None:
        raise hf.refuse("sliding_window", window, "this architecture has no sliding-window attention")
    return hf.attention_layers(n_layers, head_dim)


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str = "") -> dict[str, Tensor]:
    """Reads every tensor the model needs, renamed to ours; a missing or mis-shaped one is a
    ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-llama")), cfg)   # doctest: +SKIP
        >>> tensors["blocks.0.attn._W_K_lin"].shape                                    # doctest: +SKIP
        torch.Size([16, 48])
    """
    V, D, M = cfg.d_vocab, cfg.d_model, cfg.d_mlp
    HK, GK = cfg.n_heads * cfg.d_head, cfg.n_key_value_heads * cfg.d_head
    out = {"embed.W_E": ckpt.take("model.embed_tokens.weight", (V, D)),
           "ln_final.w": ckpt.take("model.norm.weight", (D,))}
    if not cfg.tie_embeddings:
        out["unembed._W_U_lin"] = ckpt.take("lm_head.weight", (V, D))
    elif ckpt.has("lm_head.weight"):
        ckpt.take("lm_head.weight")  # a tied checkpoint may still write the shared matrix twice
    attn_shapes = {"q": ((HK, D), (HK,)), "k": ((GK, D), (GK,)), "v": ((GK, D), (GK,)), "o": ((D, HK), (D,))}
    for layer in range(cfg.n_layers):
        hf, ours = f"model.layers.{layer}", f"blocks.{layer}"
        out[f"{ours}.ln1.w"] = ckpt.take(f"{hf}.input_layernorm.weight", (D,))
        out[f"{ours}.ln2.w"] = ckpt.take(f"{hf}.post_attention_layernorm.weight", (D,))
        for proj, (weight_shape, bias_shape) in attn_shapes.items():
            name = proj.upper()
            out[f"{ours}.attn._W_{name}_lin"] = ckpt.take(f"{hf}.self_attn.{proj}_proj.weight", weight_shape)
            if cfg.attn_bias:
                bias_name = f"{hf}.self_attn.{proj}_proj.bias"
                if proj == "o":  # Qwen2: QKV bias, no output bias
                    out[f"{ours}.attn.b_O"] = ckpt.take(bias_name, bias_shape) if ckpt.has(bias_name) else torch.zeros(D)
                else:
                    out[f"{ours}.attn._b_{name}_lin"] = ckpt.take(bias_name, bias_shape)
        if cfg.is_moe:
            out.update(_experts(ckpt, cfg, layer))
            continue
        for proj, name, shape in (("gate", "gate", (M, D)), ("up", "in", (M, D)), ("down", "out", (D, M))):
            out[f"{ours}.mlp._W_{name}_lin"] = ckpt.take(f"{hf}.mlp.{proj}_proj.weight", shape)
            if cfg.mlp_bias:
                out[f"{ours}.mlp.b_{name}"] = ckpt.take(f"{hf}.mlp.{proj}_proj.bias", shape[:1])
    return out


def _experts(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, layer: int) -> dict[str, Tensor]:
    """Router and stacked expert weights of one Mixtral layer, from per-expert or fused tensors."""
    E, M, D = cfg.num_experts, cfg.d_mlp, cfg.d_model
    hf, ours = f"model.layers.{layer}", f"blocks.{layer}.mlp"
    fused = f"{hf}.mlp.experts.gate_up_proj"
    if ckpt.has(fused):
        gate_up_E2MD = ckpt.take(fused, (E, 2 * M, D))
        return {f"{ours}._W_router_lin": ckpt.take(f"{hf}.mlp.gate.weight", (E, D)),
                f"{ours}._W_gate_lin": gate_up_E2MD[:, :M], f"{ours}._W_in_lin": gate_up_E2MD[:, M:],
                f"{ours}._W_out_lin": ckpt.take(f"{hf}.mlp.experts.down_proj", (E, D, M))}
    moe = f"{hf}.block_sparse_moe"
    stacked = {ours_name: torch.stack([ckpt.take(f"{moe}.experts.{e}.{w}.weight", shape) for e in range(E)])
               for w, ours_name, shape in (("w1", "_W_gate_lin", (M, D)), ("w3", "_W_in_lin", (M, D)),
                                           ("w2", "_W_out_lin", (D, M)))}
    return {f"{ours}._W_router_lin": ckpt.take(f"{moe}.gate.weight", (E, D)),
            **{f"{ours}.{k}": v for k, v in stacked.items()}}
