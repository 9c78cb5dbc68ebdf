"""DBRX in HF format: a pre-norm mixture-of-experts decoder with its own config layout and tensor names.

Legend: E num_experts, H n_heads, G n_key_value_heads, K d_head, M d_mlp, D d_model, V d_vocab.

What the config values mean (read off transformers 5.24's ``modeling_dbrx.py``): ``d_model``, ``n_heads``,
``n_layers``, ``max_seq_len``; ``attn_config`` {``kv_n_heads``, ``clip_qkv`` (the fused q/k/v clamped),
``rope_theta``}; ``ffn_config`` {``ffn_hidden_size``, ``moe_num_experts``, ``moe_top_k``, ``ffn_act_fn``,
``moe_normalize_expert_weights``: the top-k softmax probabilities divided by their p-norm, p = 1 being our
renormalisation (other p are refused; null: none)}. LayerNorms without biases (eps 1e-5); RoPE on halves.

HF tensor names -> ours:

    transformer.wte.weight -> embed.W_E;  transformer.norm_f.weight -> ln_final.w;  lm_head.weight
    transformer.blocks.{l}.norm_attn_norm.norm_1 / norm_2 -> blocks.{l}.ln1 / ln2 (.w; .b zeros)
    ...norm_attn_norm.attn.Wqkv [HK + 2GK, D] -> attn._W_{Q,K,V}_lin (cut by rows); .out_proj -> attn._W_O_lin
    ...ffn.router.layer.weight [E, D] -> mlp._W_router_lin
    ...ffn.experts.mlp.w1 / v1 [E*M, D] -> mlp._W_gate_lin / _W_in_lin [E, M, D]; w2 [E*M, D] -> _W_out_lin [E, D, M]
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from workbench.config import MoEConfig, ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig

LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default: DBRX's config has no field for it


def model_config(hf: HFConfig, architecture: str) -> ModelConfig:
    """Maps a DBRX ``config.json`` onto ``ModelConfig``; values we cannot honour name their field.

    Example:
        >>> hf = HFConfig({"d_model": 48, "n_heads": 4, "n_layers": 2, "max_seq_len": 64, "vocab_size": 101,
        ...                "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ...                "ffn_config": {"ffn_hidden_size": 20, "moe_num_experts": 4, "moe_top_k": 2}}, "config.json")
        >>> cfg = model_config(hf, "DbrxForCausalLM")
        >>> cfg.n_key_value_heads, cfg.clip_qkv, cfg.num_experts, cfg.moe.router_renormalize
        (2, 8.0, 4, True)
    """
    attn, ffn = _section(hf, "attn_config"), _section(hf, "ffn_config")
    d_model, n_heads = int(hf.require("d_model")), int(hf.require("n_heads"))
    p = ffn.get("moe_normalize_expert_weights", 1.0)
    if p is not None and float(p) != 1.0:
        raise hf.refuse("ffn_config.moe_normalize_expert_weights", p, "only the 1-norm (renormalising to sum to one) "
                                                                      "or none (null) is supported")
    activation = (ffn.get("ffn_act_fn") or {}).get("name", "silu")
    act = HFConfig({"ffn_config.ffn_act_fn.name": activation}, hf.source).activation("ffn_config.ffn_act_fn.name")
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", attn.get("rope_theta", 10000.0))
    clip = attn.get("clip_qkv")
    E, k = int(ffn.get("moe_num_experts", 4)), int(ffn.get("moe_top_k", 1))
    if not 0 < k <= E:
        raise hf.refuse("ffn_config.moe_top_k", k, f"must be in 1..{E} (ffn_config.moe_num_experts)")
    return hf.model_config(
        n_layers=int(hf.require("n_layers")), d_model=d_model, n_heads=n_heads,
        n_key_value_heads=int(attn.get("kv_n_heads", 1)), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.get("max_seq_len", 2048)), d_mlp=int(ffn.get("ffn_hidden_size", 3584)),
        normalization="LN", norm_eps=LAYER_NORM_EPS, positional="rotary", rotary_base=float(theta),
        act_fn=act, gated_mlp=True, clip_qkv=None if clip is None else float(clip),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), num_experts=E, experts_per_token=k,
        moe=MoEConfig(router_renormalize=p is not None),
    )


def _section(hf: HFConfig, name: str) -> dict[str, Any]:
    section = hf.get(name) or {}
    if not isinstance(section, dict):
        raise hf.refuse(name, section, "expected a mapping")
    return section


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str) -> dict[str, Tensor]:
    """Reads every tensor the model needs, renamed (and cut) to ours; a missing or mis-shaped one names itself.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-dbrx")), cfg, "DbrxForCausalLM")  # doctest: +SKIP
    """
    V, D, H, G, K = cfg.d_vocab, cfg.d_model, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head
    E, M = cfg.num_experts, cfg.d_mlp
    out = {"embed.W_E": ckpt.take("transformer.wte.weight", (V, D)),
           "ln_final.w": ckpt.take("transformer.norm_f.weight", (D,))}
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    zeros = torch.zeros(D, dtype=out["embed.W_E"].dtype)
    out["ln_final.b"] = zeros.clone()
    for layer in range(cfg.n_layers):
        hf, ours = f"transformer.blocks.{layer}", f"blocks.{layer}"
        for norm, our_norm in (("norm_1", "ln1"), ("norm_2", "ln2")):
            out[f"{ours}.{our_norm}.w"] = ckpt.take(f"{hf}.norm_attn_norm.{norm}.weight", (D,))
            out[f"{ours}.{our_norm}.b"] = zeros.clone()
        qkv = ckpt.take(f"{hf}.norm_attn_norm.attn.Wqkv.weight", (H * K + 2 * G * K, D))
        out[f"{ours}.attn._W_Q_lin"], out[f"{ours}.attn._W_K_lin"], out[f"{ours}.attn._W_V_lin"] = (
            part.contiguous() for part in qkv.split([H * K, G * K, G * K]))
        out[f"{ours}.attn._W_O_lin"] = ckpt.take(f"{hf}.norm_attn_norm.attn.out_proj.weight", (D, H * K))
        experts = f"{hf}.ffn.experts.mlp"
        out[f"{ours}.mlp._W_router_lin"] = ckpt.take(f"{hf}.ffn.router.layer.weight", (E, D))
        out[f"{ours}.mlp._W_gate_lin"] = ckpt.take(f"{experts}.w1", (E * M, D)).view(E, M, D)
        out[f"{ours}.mlp._W_in_lin"] = ckpt.take(f"{experts}.v1", (E * M, D)).view(E, M, D)
        out[f"{ours}.mlp._W_out_lin"] = ckpt.take(f"{experts}.w2", (E * M, D)).view(E, M, D).transpose(1, 2).contiguous()
    return out


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={"DbrxForCausalLM": ("dbrx", "Databricks DBRX (fine-grained experts, clip_qkv, bias-free LayerNorms)")},
    model_config=model_config,
    convert_tensors=convert_tensors,
    ignored_tensors=re.compile(r".*rotary_emb\.inv_freq$"),
),)
