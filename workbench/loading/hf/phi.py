"""Phi-1/1.5/2, Phi-3 and StableLM in HF format.

Legend: H n_heads, G n_key_value_heads, K d_head, D d_model, M d_mlp, V d_vocab.

All three are pre-norm RoPE decoders with partial rotary (``partial_rotary_factor``: the first
``rotary_dim`` dimensions of each head rotate, in halves). They differ in config values, which
``Variant`` records:

- Phi-1/1.5/2 (``phi``): a parallel block with ONE LayerNorm, ``x + attn(ln(x)) + mlp(ln(x))``;
  biased q/k/v/dense, a biased gelu MLP (fc1, fc2), a biased ``lm_head``; optional
  ``qk_layernorm`` (one LayerNorm over d_head, with bias, shared by every head). Partial rotary
  0.5 unless the config says otherwise.
- Phi-3 (``phi3``): Llama-like (RMSNorm, SwiGLU, no biases) with q/k/v fused into ``qkv_proj``
  and gate/up fused into ``gate_up_proj``; one optional ``sliding_window`` for every layer.
  Unscaled RoPE or ``longrope`` (which Phi-3 also spells ``su`` or ``yarn``: the 128k checkpoints), its
  short/long factors and attention factor as ``rotary_scaling`` (original context 4096 unless the config says).
- StableLM (``stablelm``): LayerNorm with bias, SwiGLU, optional q/k/v bias (``use_qkv_bias``,
  never on o_proj), optional ``qk_layernorm`` with a separate bias-free LayerNorm per head,
  optional ``use_parallel_residual`` (then one ``input_layernorm`` feeds both branches).
  Partial rotary 0.25 unless the config says otherwise.

A single norm that feeds both branches of a parallel block is loaded as two equal copies, ln1
and ln2. A QK norm shared across heads is repeated per head ([K] -> [H, K] / [G, K]); a
bias-free one gets zero biases. HF tensor names (transformers 5.23 ``save_pretrained``) and
ours (the nn.Linear-layout storage, whose TransformerLens views are ``W_Q``, ``W_in``, ``W_U`` ...):

    model.embed_tokens.weight                        -> embed.W_E
    model.layers.{l}.input_layernorm                 -> blocks.{l}.ln1 (.w, .b)  (and ln2 when parallel)
    model.layers.{l}.post_attention_layernorm        -> blocks.{l}.ln2           (Phi-3; StableLM sequential)
    model.layers.{l}.self_attn.{q,k,v}_proj          -> blocks.{l}.attn._W_{Q,K,V}_lin (+ .bias -> _b_{Q,K,V}_lin)
    model.layers.{l}.self_attn.qkv_proj  [HK+2GK, D] -> the same, cut as q rows, k rows, v rows (Phi-3)
    model.layers.{l}.self_attn.dense / o_proj        -> blocks.{l}.attn._W_O_lin (+ .bias -> b_O; zeros if absent)
    ...self_attn.{q,k}_layernorm [K] (Phi)           -> blocks.{l}.attn.{q,k}_norm.w/.b, repeated to [H, K] / [G, K]
    ...self_attn.{q,k}_layernorm.norms.{h}.weight    -> blocks.{l}.attn.{q,k}_norm.w[h] (StableLM; .b zeros)
    model.layers.{l}.mlp.fc1 / fc2 (Phi)             -> blocks.{l}.mlp._W_in_lin / _W_out_lin (+ b_in / b_out)
    model.layers.{l}.mlp.gate_up_proj [2M, D]        -> blocks.{l}.mlp._W_gate_lin (first M rows) / _W_in_lin (Phi-3)
    model.layers.{l}.mlp.{gate,up,down}_proj         -> blocks.{l}.mlp._W_{gate,in,out}_lin (StableLM)
    model.final_layernorm (Phi) / model.norm         -> ln_final (.w, .b)
    lm_head.weight -> unembed._W_U_lin (absent when tied);  lm_head.bias (Phi) -> unembed.b_U
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig


@dataclass(frozen=True)
class Variant:
    """What distinguishes one member of the family, as data rather than branches on a name."""

    normalization: str  # "LN" (with bias) or "RMS"
    eps_field: str
    partial_rotary_factor: float  # transformers' default when the config gives none
    parallel_field: Optional[str] = None  # config field switching the parallel block on; None: parallel_always
    parallel_always: bool = False
    qk_norm_field: Optional[str] = None  # config field switching the QK LayerNorm on
    qk_norm_per_head: bool = False  # StableLM: one LayerNorm per head; Phi: one shared by all heads
    qkv_bias_field: Optional[str] = None  # StableLM: q/k/v bias on this field, o_proj never
    all_biases: bool = False  # Phi: q/k/v/dense, fc1/fc2 and lm_head all biased
    gated_mlp: bool = True
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj
    honours_sliding_window: bool = False
    longrope_only: bool = False  # Phi-3: any rope_type but "default" is longrope there
    head_dim_field: bool = True  # False: head_dim is always hidden_size // heads (StableLM's attention)
    default_act: str = "silu"
    final_norm: str = "model.norm"
    out_proj: str = "o_proj"


PHI3_ORIGINAL_CONTEXT = 4096  # Phi3Config's original_max_position_embeddings when config.json has none

VARIANTS = {
    "PhiForCausalLM": Variant(normalization="LN", eps_field="layer_norm_eps", partial_rotary_factor=0.5,
                              parallel_always=True, qk_norm_field="qk_layernorm", all_biases=True,
                              gated_mlp=False, default_act="gelu_new", final_norm="model.final_layernorm",
                              out_proj="dense"),
    "Phi3ForCausalLM": Variant(normalization="RMS", eps_field="rms_norm_eps", partial_rotary_factor=1.0,
                               fused=True, honours_sliding_window=True, longrope_only=True),
    "StableLmForCausalLM": Variant(normalization="LN", eps_field="layer_norm_eps", partial_rotary_factor=0.25,
                                   parallel_field="use_parallel_residual", qk_norm_field="qk_layernorm",
                                   qk_norm_per_head=True, qkv_bias_field="use_qkv_bias", head_dim_field=False),
}


def model_config(hf: HFConfig, architecture: str) -> ModelConfig:
    """Maps a Phi, Phi-3 or StableLM ``config.json`` onto ``ModelConfig``; unsupported values name their field.

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "num_attention_heads": 6, "num_hidden_layers": 2,
        ...                "intermediate_size": 80, "vocab_size": 101, "max_position_embeddings": 64,
        ...                "hidden_act": "gelu_new"}, "config.json")
        >>> cfg = model_config(hf, "PhiForCausalLM")
        >>> cfg.rotary_dim, cfg.parallel_attn_mlp, cfg.unembed_bias
        (4, True, True)
    """
    variant = VARIANTS[architecture]
    d_model, n_heads = int(hf.require("hidden_size")), int(hf.require("num_attention_heads"))
    head_dim = _head_dim(hf, variant, d_model, n_heads)
    qk_norm = bool(variant.qk_norm_field and hf.get(variant.qk_norm_field, False))
    attn_bias = variant.all_biases or bool(variant.qkv_bias_field and hf.get(variant.qkv_bias_field, False))
    parallel = variant.parallel_always or bool(variant.parallel_field and hf.get(variant.parallel_field, False))
    return hf.model_config(
        n_layers=int(hf.require("num_hidden_layers")), d_model=d_model, n_heads=n_heads,
        n_key_value_heads=int(hf.get("num_key_value_heads", n_heads)), d_head=head_dim,
        d_mlp=int(hf.require("intermediate_size")), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.require("max_position_embeddings")),
        normalization=variant.normalization, norm_eps=float(hf.get(variant.eps_field, 1e-5)),
        act_fn=hf.activation("hidden_act") if hf.get("hidden_act") else variant.default_act,
        gated_mlp=variant.gated_mlp, parallel_attn_mlp=parallel, qk_norm="head" if qk_norm else None,
        attn_bias=attn_bias, mlp_bias=variant.all_biases, unembed_bias=variant.all_biases,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=_sliding_window(hf, variant), **_rotary(hf, variant, head_dim),
    )


def _head_dim(hf: HFConfig, variant: Variant, d_model: int, n_heads: int) -> int:
    """``head_dim`` when the config gives one and the model reads it; StableLM's attention never does."""
    if variant.head_dim_field:
        return int(hf.get("head_dim", d_model // n_heads))
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) != d_model // n_heads:
        # StableLM's attention uses hidden_size // heads but its RoPE reads head_dim: no consistent model.
        raise hf.refuse("head_dim", head_dim, f"StableLM's attention always uses hidden_size // num_attention_heads "
                                              f"= {d_model // n_heads}")
    return d_model // n_heads


def _sliding_window(hf: HFConfig, variant: Variant) -> Optional[int]:
    """Phi-3's one window for every layer; the others have no sliding-window attention."""
    window = hf.get("sliding_window")
    if window is not None and not variant.honours_sliding_window:
        raise hf.refuse("sliding_window", window, "this architecture has no sliding-window attention")
    return None if window is None else int(window)


def _rotary(hf: HFConfig, variant: Variant, head_dim: int) -> dict[str, Any]:
    """The RoPE fields, with the family's default ``partial_rotary_factor`` when the config gives none."""
    if variant.longrope_only:
        field, kind = _rope_type(hf)
        if kind not in ("default", "longrope", "su", "yarn"):
            raise hf.refuse(field, kind, "Phi-3 runs unscaled RoPE ('default') or longrope (also written 'su' or 'yarn')")
        if kind != "default":  # transformers' Phi3Config reads all three spellings as longrope
            section, key = field.split(".")
            hf = HFConfig({"original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT, **hf.data,
                           section: {**hf.get(section), key: "longrope"}}, hf.source)
    if hf.get("partial_rotary_factor") is None:  # transformers' precedence: rope_parameters, top level, default
        hf = HFConfig({**hf.data, "partial_rotary_factor": variant.partial_rotary_factor}, hf.source)
    return hf.rotary(head_dim, longrope=variant.longrope_only)


def _rope_type(hf: HFConfig) -> tuple[str, str]:
    """(the field naming the RoPE type, the type), from ``rope_parameters`` or the older ``rope_scaling``."""
    for field in ("rope_scaling", "rope_parameters"):  # transformers: rope_scaling replaces rope_parameters
        spec = hf.get(field)
        if not spec:
            continue
        if not isinstance(spec, dict):
            raise hf.refuse(field, spec, "expected a mapping")
        for key in ("rope_type", "type"):
            if spec.get(key) is not None:
                return f"{field}.{key}", spec[key]
    return "rope_parameters.rope_type", "default"


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str) -> dict[str, Tensor]:
    """Reads every tensor the model needs, renamed (and cut, for Phi-3's fused projections) to ours;
    a missing or mis-shaped one is a ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-phi3")), cfg, "Phi3ForCausalLM")  # doctest: +SKIP
        >>> tensors["blocks.0.mlp._W_gate_lin"].shape                                                # doctest: +SKIP
        torch.Size([80, 48])
    """
    variant = VARIANTS[architecture]
    V, D = cfg.d_vocab, cfg.d_model
    out = {"embed.W_E": ckpt.take("model.embed_tokens.weight", (V, D)),
           **_norm(ckpt, cfg, variant.final_norm, "ln_final")}
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    if cfg.unembed_bias:
        out["unembed.b_U"] = ckpt.take("lm_head.bias", (V,))
    for layer in range(cfg.n_layers):
        hf, ours = f"model.layers.{layer}", f"blocks.{layer}"
        out.update(_block_norms(ckpt, cfg, hf, ours))
        out.update(_attention(ckpt, cfg, variant, f"{hf}.self_attn", f"{ours}.attn"))
        out.update(_mlp(ckpt, cfg, variant, f"{hf}.mlp", f"{ours}.mlp"))
    return out


def _norm(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, hf: str, ours: str) -> dict[str, Tensor]:
    """One [D] norm: weight, and bias for a LayerNorm."""
    out = {f"{ours}.w": ckpt.take(f"{hf}.weight", (cfg.d_model,))}
    if cfg.normalization == "LN":
        out[f"{ours}.b"] = ckpt.take(f"{hf}.bias", (cfg.d_model,))
    return out


def _block_norms(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, hf: str, ours: str) -> dict[str, Tensor]:
    """ln1 from input_layernorm; ln2 from post_attention_layernorm, or (parallel) a copy of ln1."""
    out = _norm(ckpt, cfg, f"{hf}.input_layernorm", f"{ours}.ln1")
    if cfg.parallel_attn_mlp:  # one norm feeds both branches; two copies so each can be edited alone
        out.update({name.replace(".ln1.", ".ln2."): t.clone() for name, t in out.items()})
    else:
        out.update(_norm(ckpt, cfg, f"{hf}.post_attention_layernorm", f"{ours}.ln2"))
    return out


def _attention(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, variant: Variant, hf: str, ours: str) -> dict[str, Tensor]:
    """Q, K, V (separate or cut from qkv_proj), the output projection, biases and QK norms of one layer."""
    D, HK, GK = cfg.d_model, cfg.n_heads * cfg.d_head, cfg.n_key_value_heads * cfg.d_head
    rows = {"Q": HK, "K": GK, "V": GK}
    if variant.fused:  # q rows, then k, then v
        pieces = ckpt.take(f"{hf}.qkv_proj.weight", (HK + 2 * GK, D)).split(list(rows.values()))
        # Clones: row slices would share one storage, which safetensors refuses to save.
        out = {f"{ours}._W_{name}_lin": piece.clone() for name, piece in zip(rows, pieces)}
    else:
        out = {f"{ours}._W_{name}_lin": ckpt.take(f"{hf}.{name.lower()}_proj.weight", (n, D))
               for name, n in rows.items()}
    out[f"{ours}._W_O_lin"] = ckpt.take(f"{hf}.{variant.out_proj}.weight", (D, HK))
    if cfg.attn_bias:
        out.update({f"{ours}._b_{name}_lin": ckpt.take(f"{hf}.{name.lower()}_proj.bias", (n,))
                    for name, n in rows.items()})
        bias_O = f"{hf}.{variant.out_proj}.bias"
        out[f"{ours}.b_O"] = ckpt.take(bias_O, (D,)) if variant.all_biases else torch.zeros(D)  # StableLM: none
    if cfg.qk_norm is not None:
        for name, n_heads in (("q", cfg.n_heads), ("k", cfg.n_key_value_heads)):
            read = _per_head_norm if variant.qk_norm_per_head else _shared_norm
            w, b = read(ckpt, f"{hf}.{name}_layernorm", n_heads, cfg.d_head)
            out[f"{ours}.{name}_norm.w"], out[f"{ours}.{name}_norm.b"] = w, b
    return out


def _shared_norm(ckpt: SafetensorsCheckpoint, hf: str, n_heads: int, K: int) -> tuple[Tensor, Tensor]:
    """Phi: one LayerNorm (weight and bias [K]) for every head, repeated to [n_heads, K]."""
    w_K, b_K = ckpt.take(f"{hf}.weight", (K,)), ckpt.take(f"{hf}.bias", (K,))
    return w_K.expand(n_heads, K).clone(), b_K.expand(n_heads, K).clone()


def _per_head_norm(ckpt: SafetensorsCheckpoint, hf: str, n_heads: int, K: int) -> tuple[Tensor, Tensor]:
    """StableLM: a bias-free LayerNorm per head (``norms.{h}.weight`` [K]) -> [n_heads, K], zero bias."""
    w_nK = torch.stack([ckpt.take(f"{hf}.norms.{h}.weight", (K,)) for h in range(n_heads)])
    return w_nK, torch.zeros_like(w_nK)


def _mlp(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, variant: Variant, hf: str, ours: str) -> dict[str, Tensor]:
    """The MLP of one layer: Phi's biased fc1/fc2, Phi-3's fused gate_up_proj or StableLM's SwiGLU."""
    D, M = cfg.d_model, cfg.d_mlp
    if not variant.gated_mlp:
        return {f"{ours}._W_in_lin": ckpt.take(f"{hf}.fc1.weight", (M, D)),
                f"{ours}.b_in": ckpt.take(f"{hf}.fc1.bias", (M,)),
                f"{ours}._W_out_lin": ckpt.take(f"{hf}.fc2.weight", (D, M)),
                f"{ours}.b_out": ckpt.take(f"{hf}.fc2.bias", (D,))}
    out = {f"{ours}._W_out_lin": ckpt.take(f"{hf}.down_proj.weight", (D, M))}
    if variant.fused:  # gate_up_proj(x).chunk(2): the first half is the gate
        gate_MD, up_MD = ckpt.take(f"{hf}.gate_up_proj.weight", (2 * M, D)).split(M)
        out.update({f"{ours}._W_gate_lin": gate_MD.clone(), f"{ours}._W_in_lin": up_MD.clone()})
    else:
        out.update({f"{ours}._W_gate_lin": ckpt.take(f"{hf}.gate_proj.weight", (M, D)),
                    f"{ours}._W_in_lin": ckpt.take(f"{hf}.up_proj.weight", (M, D))})
    return out


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={
        "PhiForCausalLM": ("phi", "Phi-1, Phi-1.5, Phi-2"),
        "Phi3ForCausalLM": ("phi3", "Phi-3, Phi-3.5, Phi-4 (unscaled RoPE, or longrope: the 128k checkpoints)"),
        "StableLmForCausalLM": ("stablelm", "StableLM-3B-4E1T, StableLM 2, StableCode"),
    },
    model_config=model_config,
    convert_tensors=convert_tensors,
    # Buffers older checkpoints carry that are not parameters (RoPE's inverse frequencies are recomputed).
    ignored_tensors=re.compile(r".*rotary_emb\.inv_freq$"),
),)
