"""GPT-NeoX / Pythia, GPT-J and GPT-Neo in HF format (EleutherAI's three decoder families).

Legend: L n_layers, H n_heads, K d_head, D d_model, M d_mlp, V d_vocab.

All three are LayerNorm decoders with a plain (ungated) MLP; they differ in config values and in
tensor names, which ``Layout`` records as data:

- GPT-NeoX (Pythia): partial RoPE over halves of the first ``partial_rotary_factor`` (older
  ``rotary_pct``, default 0.25) of each head, a parallel block when ``use_parallel_residual``
  (``input_layernorm`` feeds attention, ``post_attention_layernorm`` the MLP, both reading the
  block input) or a sequential one, and Q, K and V fused into one ``query_key_value`` whose output
  rows are laid out per head as [H, 3, K] (transformers views it as (..., H, 3K) and chunks the last
  dimension into q, k, v).
- GPT-J: partial RoPE over adjacent pairs (2i, 2i+1) of the first ``rotary_dim`` dimensions, base
  10000; a parallel block with ONE norm ``ln_1`` read by both attention and MLP (loaded as two
  clones, ln1 and ln2); an unembedding with a bias.
- Persimmon: GPT-NeoX's fused [H, 3, K] QKV and MLP names under ``model.layers.{l}`` (Llama's
  norm names), a sequential block, relu^2, partial RoPE over halves (default 0.5) and a LayerNorm
  ([K] gain and bias, shared by the heads; ours per head) on q and k before RoPE (``qk_layernorm``).
- GPT-Neo: learned positions, unscaled attention scores (q.k, no 1/sqrt(K)), and layers alternating
  "global" and "local" attention (``attention_types``); a local layer lets query i see key j iff
  0 <= i - j < ``window_size`` (transformers' mask is tril(1) xor tril(1, -window_size)), which is
  our ``sliding_window``. Q, K and V have no bias, the output projection has one: our Q/K/V biases
  are zeros.

HF tensor names (transformers 5.23 ``save_pretrained``) and ours (the nn.Linear-layout storage, whose
TransformerLens views are ``W_Q``, ``W_in``, ``W_U`` ...):

    GPT-NeoX                                             GPT-J / GPT-Neo (transformer.)
    gpt_neox.embed_in.weight          -> embed.W_E       wte.weight
    (none)                            -> pos_embed.W_pos wpe.weight (GPT-Neo)
    gpt_neox.layers.{l}.input_layernorm         -> blocks.{l}.ln1 (.w, .b)   h.{l}.ln_1
    gpt_neox.layers.{l}.post_attention_layernorm-> blocks.{l}.ln2 (.w, .b)   h.{l}.ln_2 (GPT-J: ln_1 again)
    ...attention.query_key_value [H, 3, K] rows -> blocks.{l}.attn._W_{Q,K,V}_lin (+ _b_{Q,K,V}_lin)
                                                 h.{l}.attn.{q,k,v}_proj (GPT-Neo: h.{l}.attn.attention.)
    ...attention.dense                -> blocks.{l}.attn._W_O_lin (+ b_O)  attn[.attention].out_proj
    ...mlp.dense_h_to_4h / dense_4h_to_h -> blocks.{l}.mlp._W_in_lin / _W_out_lin (+ b_in / b_out)
                                                 GPT-J mlp.fc_in / fc_out; GPT-Neo mlp.c_fc / c_proj
    gpt_neox.final_layer_norm         -> ln_final (.w, .b)   ln_f
    embed_out.weight (or lm_head.weight) -> unembed._W_U_lin   lm_head.weight (+ GPT-J lm_head.bias -> unembed.b_U)

A tied model (``tie_word_embeddings``) has no unembedding matrix of its own; GPT-J's tied model
still has its ``lm_head.bias``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig, per_layer_config

_NEOX_DEFAULT_ROTARY_FACTOR = 0.25  # transformers' default when neither rope_parameters nor rotary_pct says
_GPTJ_ROTARY_BASE = 10000.0  # GPT-J's sinusoid table has a fixed base (create_sinusoidal_positions)
_NEO_ATTENTION_KINDS = ("global", "local")
_NEO_DEFAULT_ATTENTION_TYPES = [[["global", "local"], 12]]  # transformers' default


@dataclass(frozen=True)
class Layout:
    """Where one architecture keeps its tensors; ``{l}`` in ``layer`` is the layer index."""

    embed: str
    final_norm: str
    unembed: tuple[str, ...]  # accepted names of the unembedding matrix, the first found is read
    layer: str
    ln1: str
    ln2: Optional[str]  # None: the block's one norm feeds the MLP too (GPT-J)
    fused_qkv: Optional[str]  # [H, 3, K] rows of q, k, v per head (GPT-NeoX); None: q/k/v_proj below
    qkv: str  # "{}" is "q", "k" or "v" (unfused)
    out: str
    mlp_in: str
    mlp_out: str
    qkv_bias: bool  # q/k/v carry biases whenever the model has attention biases (else zeros)
    pos_embed: Optional[str] = None
    unembed_bias: Optional[str] = None
    qk_norms: Optional[tuple[str, str]] = None  # Persimmon: LayerNorms [K] (gain and bias) on q and k, per head


LAYOUTS = {
    "GPTNeoXForCausalLM": Layout(
        embed="gpt_neox.embed_in", final_norm="gpt_neox.final_layer_norm",
        unembed=("embed_out.weight", "lm_head.weight"), layer="gpt_neox.layers.{l}",
        ln1="input_layernorm", ln2="post_attention_layernorm", fused_qkv="attention.query_key_value",
        qkv="", out="attention.dense", mlp_in="mlp.dense_h_to_4h", mlp_out="mlp.dense_4h_to_h", qkv_bias=True),
    "GPTJForCausalLM": Layout(
        embed="transformer.wte", final_norm="transformer.ln_f", unembed=("lm_head.weight",),
        layer="transformer.h.{l}", ln1="ln_1", ln2=None, fused_qkv=None, qkv="attn.{}_proj",
        out="attn.out_proj", mlp_in="mlp.fc_in", mlp_out="mlp.fc_out", qkv_bias=False,
        unembed_bias="lm_head.bias"),
    "GPTNeoForCausalLM": Layout(
        embed="transformer.wte", final_norm="transformer.ln_f", unembed=("lm_head.weight",),
        layer="transformer.h.{l}", ln1="ln_1", ln2="ln_2", fused_qkv=None, qkv="attn.attention.{}_proj",
        out="attn.attention.out_proj", mlp_in="mlp.c_fc", mlp_out="mlp.c_proj", qkv_bias=False,
        pos_embed="transformer.wpe"),
    # Persimmon: GPT-NeoX's fused per-head QKV in a Llama-named, sequential block; relu^2 MLP; QK LayerNorms.
    "PersimmonForCausalLM": Layout(
        embed="model.embed_tokens", final_norm="model.final_layernorm", unembed=("lm_head.weight",),
        layer="model.layers.{l}", ln1="input_layernorm", ln2="post_attention_layernorm",
        fused_qkv="self_attn.query_key_value", qkv="", out="self_attn.dense", mlp_in="mlp.dense_h_to_4h",
        mlp_out="mlp.dense_4h_to_h", qkv_bias=True, qk_norms=("self_attn.q_layernorm", "self_attn.k_layernorm")),
}


def model_config(hf: HFConfig, architecture: str) -> ModelConfig:
    """Maps a GPT-NeoX, GPT-J or GPT-Neo ``config.json`` onto ``ModelConfig``; a value we cannot
    honour is a ``ConfigError`` naming its field.

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "num_attention_heads": 6, "num_hidden_layers": 2,
        ...                "intermediate_size": 80, "vocab_size": 101, "max_position_embeddings": 64,
        ...                "hidden_act": "gelu", "rotary_pct": 0.5}, "config.json")
        >>> cfg = model_config(hf, "GPTNeoXForCausalLM")
        >>> cfg.rotary_dim, cfg.parallel_attn_mlp
        (4, True)
    """
    return hf.model_config(**_CONFIGS[architecture](hf))


def _neox_fields(hf: HFConfig) -> dict[str, Any]:
    d_model, n_heads = int(hf.require("hidden_size")), int(hf.require("num_attention_heads"))
    return dict(
        n_layers=int(hf.require("num_hidden_layers")), d_model=d_model, n_heads=n_heads,
        d_mlp=int(hf.require("intermediate_size")), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.require("max_position_embeddings")), normalization="LN",
        norm_eps=float(hf.get("layer_norm_eps", 1e-5)), act_fn=hf.activation("hidden_act"),
        parallel_attn_mlp=bool(hf.get("use_parallel_residual", True)),
        attn_bias=bool(hf.get("attention_bias", True)), mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **_neox_rotary(hf, d_model // n_heads),
    )


def _neox_rotary(hf: HFConfig, head_dim: int) -> dict[str, Any]:
    """RoPE fields as transformers' ``GPTNeoXConfig`` resolves them: ``rope_scaling`` (legacy) replaces
    ``rope_parameters``; the older ``rotary_emb_base`` / ``rotary_pct`` fill what neither gives, and
    the rotary fraction defaults to 0.25, not 1."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(hf.get(field) or {})
    params.setdefault("rope_theta", hf.get("rotary_emb_base", 10000.0))
    params.setdefault("partial_rotary_factor", hf.get("rotary_pct", _NEOX_DEFAULT_ROTARY_FACTOR))
    # Top-level rope_theta / partial_rotary_factor play no part for GPT-NeoX: leave them out.
    others = {k: v for k, v in hf.data.items()
              if k not in ("rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor")}
    return HFConfig({**others, field: params}, hf.source).rotary(head_dim)


def _persimmon_fields(hf: HFConfig) -> dict[str, Any]:
    """Persimmon: a sequential LayerNorm block, RoPE over halves of the first half of each head (default
    partial_rotary_factor 0.5), a per-head LayerNorm on q and k when ``qk_layernorm`` (default on)."""
    d_model, n_heads = int(hf.require("hidden_size")), int(hf.require("num_attention_heads"))
    data = {"partial_rotary_factor": 0.5, **hf.data}
    return dict(
        n_layers=int(hf.require("num_hidden_layers")), d_model=d_model, n_heads=n_heads,
        d_mlp=int(hf.require("intermediate_size")), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.require("max_position_embeddings")), normalization="LN",
        norm_eps=float(hf.get("layer_norm_eps", 1e-5)), act_fn=hf.activation("hidden_act"),
        attn_bias=True, mlp_bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm="head" if hf.get("qk_layernorm", True) else None,
        **HFConfig(data, hf.source).rotary(d_model // n_heads),
    )


def _gptj_fields(hf: HFConfig) -> dict[str, Any]:
    d_model, n_heads = int(hf.require("n_embd")), int(hf.require("n_head"))
    head_dim = d_model // n_heads
    # transformers rotates the first rotary_dim dimensions of each head; with rotary_dim null its
    # sin/cos table spans all of d_model, which only fits a single head.
    rotary_dim = hf.get("rotary_dim", d_model if n_heads == 1 else None)
    if rotary_dim is None or not 0 < int(rotary_dim) <= head_dim or int(rotary_dim) % 2:
        raise hf.refuse("rotary_dim", rotary_dim, f"must be even and in 2..head_dim={head_dim}")
    return dict(
        n_layers=int(hf.require("n_layer")), d_model=d_model, n_heads=n_heads,
        d_mlp=int(hf.get("n_inner", 4 * d_model)), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.require("n_positions")), normalization="LN",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), act_fn=hf.activation("activation_function"),
        positional="rotary", rotary_base=_GPTJ_ROTARY_BASE, rotary_dim=int(rotary_dim),
        rotary_adjacent_pairs=True, parallel_attn_mlp=True, attn_bias=False, mlp_bias=True,
        unembed_bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _neo_fields(hf: HFConfig) -> dict[str, Any]:
    d_model, n_layers = int(hf.require("hidden_size")), int(hf.require("num_layers"))
    return dict(
        n_layers=n_layers, d_model=d_model, n_heads=int(hf.require("num_heads")),
        d_mlp=int(hf.get("intermediate_size", 4 * d_model)), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.require("max_position_embeddings")), normalization="LN",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), act_fn=hf.activation("activation_function"),
        positional="learned", attn_scale=1.0,  # GPT-Neo never scales q.k
        attn_bias=True, mlp_bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        **per_layer_config([{"sliding_window": window} for window in _neo_windows(hf, n_layers)]),
    )


def _neo_windows(hf: HFConfig, n_layers: int) -> list[Optional[int]]:
    """Each layer's sliding window: ``window_size`` for a "local" layer, None for a "global" one.

    ``attention_types`` ([[kinds, repeats], ...]) is what transformers expands into the layers' kinds
    (a saved ``attention_layers`` is recomputed from it on load).

    Example:
        >>> _neo_windows(HFConfig({"attention_types": [[["global", "local"], 1]], "window_size": 5}, "c"), 2)
        [None, 5]
    """
    types = hf.get("attention_types", _NEO_DEFAULT_ATTENTION_TYPES)
    try:
        kinds = [kind for group, repeats in types for _ in range(int(repeats)) for kind in group]
    except (TypeError, ValueError) as error:
        raise hf.refuse("attention_types", types, "expected [[[kind, ...], repeats], ...]") from error
    unknown = sorted(set(kinds) - set(_NEO_ATTENTION_KINDS))
    if unknown:
        raise hf.refuse("attention_types", types, f"unknown attention kind(s) {unknown}; known: {_NEO_ATTENTION_KINDS}")
    if len(kinds) != n_layers:
        raise hf.refuse("attention_types", types, f"gives {len(kinds)} layers, num_layers is {n_layers}")
    window = int(hf.get("window_size", 256))
    if "local" in kinds and window <= 0:
        raise hf.refuse("window_size", window, "must be positive")
    return [window if kind == "local" else None for kind in kinds]


_CONFIGS: dict[str, Callable[[HFConfig], dict[str, Any]]] = {
    "GPTNeoXForCausalLM": _neox_fields,
    "GPTJForCausalLM": _gptj_fields,
    "GPTNeoForCausalLM": _neo_fields,
    "PersimmonForCausalLM": _persimmon_fields,
}


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str) -> dict[str, Tensor]:
    """Reads every tensor the model needs, renamed (and the fused QKV split) to ours; a missing or
    mis-shaped one is a ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-pythia")), cfg,
        ...                           "GPTNeoXForCausalLM")                           # doctest: +SKIP
        >>> tensors["blocks.0.attn._W_Q_lin"].shape                                   # doctest: +SKIP
        torch.Size([48, 48])
    """
    layout = LAYOUTS[architecture]
    V, D = cfg.d_vocab, cfg.d_model
    out = {"embed.W_E": ckpt.take(f"{layout.embed}.weight", (V, D)),
           **_layer_norm(ckpt, layout.final_norm, "ln_final", D)}
    if layout.pos_embed is not None:
        out["pos_embed.W_pos"] = ckpt.take(f"{layout.pos_embed}.weight", (cfg.n_ctx, D))
    out.update(_unembed(ckpt, cfg, layout))
    for layer in range(cfg.n_layers):
        out.update(_block(ckpt, cfg, layout, layer))
    return out


def _unembed(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, layout: Layout) -> dict[str, Tensor]:
    """The unembedding matrix (absent when tied: a tied checkpoint may still hold a copy, read and
    dropped) and GPT-J's bias."""
    out = {}
    name = next((n for n in layout.unembed if ckpt.has(n)), layout.unembed[0])
    out.update(ckpt.take_unembedding(name, (cfg.d_vocab, cfg.d_model), cfg.tie_embeddings))
    if layout.unembed_bias is not None:
        out["unembed.b_U"] = ckpt.take(layout.unembed_bias, (cfg.d_vocab,))
    return out


def _block(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, layout: Layout, layer: int) -> dict[str, Tensor]:
    """One block's norms, attention and MLP under our names."""
    hf, ours = layout.layer.format(l=layer), f"blocks.{layer}"
    D, M = cfg.d_model, cfg.d_mlp
    out = _layer_norm(ckpt, f"{hf}.{layout.ln1}", f"{ours}.ln1", D)
    if layout.ln2 is None:  # GPT-J: one norm for both; two clones so each can be edited alone
        out.update({f"{ours}.ln2.{p}": out[f"{ours}.ln1.{p}"].clone() for p in ("w", "b")})
    else:
        out.update(_layer_norm(ckpt, f"{hf}.{layout.ln2}", f"{ours}.ln2", D))
    out.update(_attention(ckpt, cfg, layout, hf, f"{ours}.attn"))
    for hf_name, ours_name, bias_name, shape in ((layout.mlp_in, "_W_in_lin", "b_in", (M, D)),
                                                 (layout.mlp_out, "_W_out_lin", "b_out", (D, M))):
        out[f"{ours}.mlp.{ours_name}"] = ckpt.take(f"{hf}.{hf_name}.weight", shape)
        out[f"{ours}.mlp.{bias_name}"] = ckpt.take(f"{hf}.{hf_name}.bias", shape[:1])
    return out


def _attention(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, layout: Layout, hf: str, ours: str) -> dict[str, Tensor]:
    """W_Q, W_K, W_V (split from GPT-NeoX's fused rows), W_O and, with attention biases, all four
    biases (zeros for those the checkpoint has none of: GPT-Neo's q/k/v)."""
    H, K, D = cfg.n_heads, cfg.d_head, cfg.d_model
    weights, biases = {}, {}
    if layout.fused_qkv is not None:
        weight_H3KD = ckpt.take(f"{hf}.{layout.fused_qkv}.weight", (3 * H * K, D)).view(H, 3, K, D)
        bias_H3K = ckpt.take(f"{hf}.{layout.fused_qkv}.bias", (3 * H * K,)).view(H, 3, K) if cfg.attn_bias else None
        for index, name in enumerate("QKV"):
            weights[name] = weight_H3KD[:, index].reshape(H * K, D)
            if bias_H3K is not None:
                biases[name] = bias_H3K[:, index].reshape(H * K)
    else:
        for name in "QKV":
            proj = f"{hf}.{layout.qkv.format(name.lower())}"
            weights[name] = ckpt.take(f"{proj}.weight", (H * K, D))
            if cfg.attn_bias:
                biases[name] = ckpt.take(f"{proj}.bias", (H * K,)) if layout.qkv_bias else torch.zeros(H * K)
    out = {f"{ours}._W_{name}_lin": weight for name, weight in weights.items()}
    out[f"{ours}._W_O_lin"] = ckpt.take(f"{hf}.{layout.out}.weight", (D, H * K))
    if cfg.attn_bias:
        out.update({f"{ours}._b_{name}_lin": bias for name, bias in biases.items()})
        out[f"{ours}.b_O"] = ckpt.take(f"{hf}.{layout.out}.bias", (D,))
    if layout.qk_norms is not None and cfg.qk_norm is not None:  # one [K] LayerNorm for every head: ours per head
        for name, hf_norm in zip(("q_norm", "k_norm"), layout.qk_norms):
            for ours_param, hf_param in (("w", "weight"), ("b", "bias")):
                out[f"{ours}.{name}.{ours_param}"] = ckpt.take(f"{hf}.{hf_norm}.{hf_param}", (K,)).expand(H, K).clone()
    return out


def _layer_norm(ckpt: SafetensorsCheckpoint, hf: str, ours: str, D: int) -> dict[str, Tensor]:
    return {f"{ours}.w": ckpt.take(f"{hf}.weight", (D,)), f"{ours}.b": ckpt.take(f"{hf}.bias", (D,))}


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={
        "GPTNeoXForCausalLM": ("gpt_neox", "GPT-NeoX, Pythia (partial RoPE; parallel or sequential blocks)"),
        "GPTJForCausalLM": ("gptj", "GPT-J"),
        "GPTNeoForCausalLM": ("gpt_neo", "GPT-Neo, TinyStories (global and local attention layers)"),
        "PersimmonForCausalLM": ("persimmon", "Adept Persimmon, Fuyu's decoder (relu^2, QK LayerNorm, partial rotary)"),
    },
    model_config=model_config,
    convert_tensors=convert_tensors,
    # Buffers older checkpoints carry that are not parameters: causal masks (``bias``, ``masked_bias``)
    # and RoPE's inverse frequencies, all recomputed.
    ignored_tensors=re.compile(
        r"gpt_neox\.(layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)|rotary_emb\.inv_freq)"
        r"|transformer\.h\.\d+\.attn\.(attention\.)?(bias|masked_bias)"
        r"|model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq"),
),)
