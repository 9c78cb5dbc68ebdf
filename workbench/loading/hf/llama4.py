"""Llama 4's text decoder in HF format (``Llama4ForCausalLM``, model_type ``llama4_text``).

Legend: E num_experts, H n_heads, G n_key_value_heads, K d_head, M d_mlp, D d_model, V d_vocab.

What the config values mean (read off transformers 5.24's ``modeling_llama4.py``), each a ModelConfig
value, per layer where layers differ (``layer_overrides``):

    RoPE        on adjacent pairs (complex multiplication), on the layers ``no_rope_layers`` marks 1
                (default: all but every ``no_rope_layer_interval``-th); the others are NoPE layers
    chunked     ``layer_types`` "chunked_attention" (default: the RoPE layers when ``attention_chunk_size``
                is set): a query sees only its own chunk of attention_chunk_size positions
    QK norm     ``use_qk_norm``: q and k L2-normed per head after RoPE (an RMS norm without gain, eps
                rms_norm_eps; ours holds gains of one), on the RoPE layers only
    temperature ``attn_temperature_tuning`` on the NoPE layers: queries times
                1 + attn_scale * log(1 + floor((position + 1) / floor_scale))
    MoE         on ``moe_layers`` (default: every ``interleave_moe_layer_step``-th): the top k of the router
                logits, each expert's input times the sigmoid of its logit (expert(w x)), plus an ungated
                shared expert of intermediate_size; the other layers a dense SwiGLU of intermediate_size_mlp

HF tensor names -> ours: self_attn.{q,k,v,o}_proj -> attn._W_{Q,K,V,O}_lin (+ biases with attention_bias);
feed_forward.router -> mlp._W_router_lin; feed_forward.experts.gate_up_proj [E, D, 2M] (gate columns
first) and down_proj [E, M, D], used as x @ W -> mlp._W_{gate,in}_lin [E, M, D], _W_out_lin [E, D, M];
feed_forward.shared_expert.* -> mlp.shared.*; dense layers feed_forward.{gate,up,down}_proj -> mlp.*;
norms, embeddings and lm_head as Llama's.

Padded batches: our temperature reads each row's own positions (from its first real token), so a padded
row equals its prompt alone; transformers' reads the absolute index, so its left-padded rows differ.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from workbench.config import MoEConfig, ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig, per_layer_config
from workbench.loading.hf.experts import dense_gated_mlp

LAYER_TYPES = ("full_attention", "chunked_attention")
# transformers' defaults for fields missing from config.json, where they matter.
DEFAULTS = {"num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "use_qk_norm": True,
            "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "attn_temperature_tuning": True,
            "floor_scale": 8192, "attn_scale": 0.1, "rms_norm_eps": 1e-5, "intermediate_size_mlp": 16384,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}


def model_config(hf: HFConfig, architecture: str) -> ModelConfig:
    """Maps a Llama 4 text ``config.json`` onto ``ModelConfig``; values we cannot honour name their field.

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
        ...                "num_hidden_layers": 4, "intermediate_size": 20, "intermediate_size_mlp": 80,
        ...                "vocab_size": 101, "max_position_embeddings": 64, "hidden_act": "silu",
        ...                "num_local_experts": 4, "interleave_moe_layer_step": 2, "attention_chunk_size": 8},
        ...               "config.json")
        >>> cfg = model_config(hf, "Llama4ForCausalLM")
        >>> cfg.moe_layers, cfg.layer_values("attention_chunk_size"), cfg.layer_values("positional")[3]
        ([1, 3], [8, 8, 8, None], 'none')
    """
    hf = HFConfig({**DEFAULTS, **{k: v for k, v in hf.data.items() if v is not None or k == "attention_chunk_size"}},
                  hf.source)
    d_model, n_heads = int(hf.require("hidden_size")), int(hf.require("num_attention_heads"))
    n_layers = int(hf.require("num_hidden_layers"))
    head_dim = int(hf.get("head_dim") or d_model // n_heads)
    layers = [_layer(hf, layer, head_dim, kind, has_rope, is_moe)
              for layer, (kind, has_rope, is_moe) in enumerate(zip(*_layer_plan(hf, n_layers)))]
    base = next((layer for layer, fields in enumerate(layers) if fields["num_experts"]), 0)
    return hf.model_config(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_key_value_heads=int(hf.get("num_key_value_heads", n_heads)),
        d_head=head_dim, d_vocab=int(hf.require("vocab_size")), n_ctx=int(hf.require("max_position_embeddings")),
        normalization="RMS", norm_eps=float(hf.get("rms_norm_eps")), act_fn=hf.activation("hidden_act"), gated_mlp=True,
        attn_bias=bool(hf.get("attention_bias", False)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rotary_adjacent_pairs=True, qk_norm_after_rotary=True, query_scale_position_offset=1,
        moe=MoEConfig(router_scoring="topk_sigmoid", router_renormalize=False, router_weights_input=True,
                      d_shared_expert=int(hf.require("intermediate_size"))),
        **per_layer_config(layers, base=base),
    )


def _layer_plan(hf: HFConfig, n_layers: int) -> tuple[list[str], list[bool], list[bool]]:
    """Per layer: its attention kind, whether it has RoPE and whether its MLP is a mixture of experts."""
    interval = int(hf.get("no_rope_layer_interval"))
    has_rope = hf.get("no_rope_layers") or [int((layer + 1) % interval != 0) for layer in range(n_layers)]
    if len(has_rope) != n_layers:
        raise hf.refuse("no_rope_layers", has_rope, f"expected one entry per layer ({n_layers})")
    step = int(hf.get("interleave_moe_layer_step"))
    if step < 1:
        raise hf.refuse("interleave_moe_layer_step", step, "must be a positive integer")
    moe_layers = hf.get("moe_layers")
    moe_layers = set(range(step - 1, n_layers, step) if moe_layers is None else moe_layers)
    chunk = hf.get("attention_chunk_size")
    kinds = hf.get("layer_types") or ["chunked_attention" if rope and chunk is not None else "full_attention"
                                      for rope in has_rope]
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown or len(kinds) != n_layers:
        raise hf.refuse("layer_types", kinds, f"expected one of {LAYER_TYPES} per layer ({n_layers})")
    if "chunked_attention" in kinds and chunk is None:
        raise hf.refuse("attention_chunk_size", chunk, "layer_types has chunked layers but no chunk size")
    return kinds, [bool(rope) for rope in has_rope], [layer in moe_layers for layer in range(n_layers)]


def _layer(hf: HFConfig, layer: int, head_dim: int, kind: str, has_rope: bool, is_moe: bool) -> dict[str, Any]:
    """One layer's own values of the per-layer fields."""
    temperature = not has_rope and bool(hf.get("attn_temperature_tuning"))
    fields = {**hf.rotary(head_dim), "sliding_window": None,
              "attention_chunk_size": int(hf.get("attention_chunk_size")) if kind == "chunked_attention" else None,
              "qk_norm": "head" if has_rope and hf.get("use_qk_norm") else None,
              "query_scale_beta": float(hf.get("attn_scale")) if temperature else None,
              "query_scale_length": int(hf.get("floor_scale")) if temperature else None}
    if not has_rope:
        fields["positional"] = "none"
    if is_moe:
        k = int(hf.require("num_experts_per_tok"))
        fields.update(num_experts=int(hf.require("num_local_experts")), experts_per_token=k,
                      d_mlp=int(hf.require("intermediate_size")))
    else:
        fields.update(num_experts=0, experts_per_token=0, d_mlp=int(hf.require("intermediate_size_mlp")))
    return fields


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str) -> dict[str, Tensor]:
    """Reads every tensor the model needs, renamed to ours (a missing or mis-shaped one names itself).

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-llama4")), cfg, "Llama4ForCausalLM")  # doctest: +SKIP
    """
    V, D = cfg.d_vocab, cfg.d_model
    out = {"embed.W_E": ckpt.take("model.embed_tokens.weight", (V, D)),
           "ln_final.w": ckpt.take("model.norm.weight", (D,))}
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    for layer in range(cfg.n_layers):
        hf, ours, layer_cfg = f"model.layers.{layer}", f"blocks.{layer}", cfg.for_layer(layer)
        out[f"{ours}.ln1.w"] = ckpt.take(f"{hf}.input_layernorm.weight", (D,))
        out[f"{ours}.ln2.w"] = ckpt.take(f"{hf}.post_attention_layernorm.weight", (D,))
        out.update(_attention(ckpt, layer_cfg, layer))
        if layer_cfg.is_moe:
            out.update(_experts(ckpt, layer_cfg, layer))
        else:
            out.update(dense_gated_mlp(ckpt, f"{hf}.feed_forward", f"{ours}.mlp", layer_cfg.d_mlp, D))
    return out


def _attention(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, layer: int) -> dict[str, Tensor]:
    H, G, K, D = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model
    hf, ours = f"model.layers.{layer}.self_attn", f"blocks.{layer}.attn"
    out = {}
    for proj, rows in (("q", H * K), ("k", G * K), ("v", G * K), ("o", D)):
        shape = (rows, D) if proj != "o" else (D, H * K)
        out[f"{ours}._W_{proj.upper()}_lin"] = ckpt.take(f"{hf}.{proj}_proj.weight", shape)
        if cfg.attn_bias:
            out[f"{ours}.b_O" if proj == "o" else f"{ours}._b_{proj.upper()}_lin"] = ckpt.take(f"{hf}.{proj}_proj.bias",
                                                                                               (rows,))
    if cfg.qk_norm is not None:  # the L2 norm has no gain: ours holds ones
        like = out[f"{ours}._W_Q_lin"]
        out[f"{ours}.q_norm.w"] = torch.ones(H, K, dtype=like.dtype)
        out[f"{ours}.k_norm.w"] = torch.ones(G, K, dtype=like.dtype)
    return out


def _experts(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, layer: int) -> dict[str, Tensor]:
    E, M, D = cfg.num_experts, cfg.d_mlp, cfg.d_model
    hf, ours = f"model.layers.{layer}.feed_forward", f"blocks.{layer}.mlp"
    gate_up_ED2M = ckpt.take(f"{hf}.experts.gate_up_proj", (E, D, 2 * M))
    out = {f"{ours}._W_router_lin": ckpt.take(f"{hf}.router.weight", (E, D)),
           f"{ours}._W_gate_lin": gate_up_ED2M[..., :M].transpose(1, 2).contiguous(),
           f"{ours}._W_in_lin": gate_up_ED2M[..., M:].transpose(1, 2).contiguous(),
           f"{ours}._W_out_lin": ckpt.take(f"{hf}.experts.down_proj", (E, M, D)).transpose(1, 2).contiguous()}
    out.update(dense_gated_mlp(ckpt, f"{hf}.shared_expert", f"{ours}.shared", cfg.moe.d_shared_expert, D))
    return out


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={"Llama4ForCausalLM": ("llama4_text", "Llama 4 Scout / Maverick text decoder (MoE with a shared "
                                                        "expert, chunked attention, NoPE layers, QK L2 norm)")},
    model_config=model_config,
    convert_tensors=convert_tensors,
    ignored_tensors=re.compile(r".*rotary_emb\.inv_freq$"),
),)
