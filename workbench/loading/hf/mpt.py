"""MPT in HF format (``MptForCausalLM``: MPT-7B, MPT-30B and their fine-tunes), read off transformers
5.24's ``modeling_mpt.py``.

Legend: H n_heads, K d_head, D d_model, V d_vocab.

MPT is a pre-norm decoder with ALiBi, multi-head attention, a 4x exact-GELU MLP, tied embeddings,
no biases anywhere (its LayerNorms have a gain only: our biases are zeros) and q, k and v clamped
to ``attn_config.clip_qkv`` when set (transformers clamps the fused projection, the same thing).
Its ALiBi slopes (``build_mpt_alibi_tensor``) equal BLOOM's for every head count (for a
non-power of two, MPT's interleaving of the next power's slopes picks the same values), and its
bias, ``slope * (k - last key)``, differs from ours (``slope * (k - q)``) by a constant per query
row, which the softmax ignores. ``softmax_scale`` replaces 1/sqrt(d_head).

transformers' MPT reads only some of MPT's config: it always applies ALiBi with a maximum bias of
8, always builds a 4x MLP without biases, and never scales the logits. A checkpoint asking for
anything else (``attn_config.alibi`` false, ``alibi_bias_max`` != 8, ``expansion_ratio`` != 4,
``no_bias`` false, ``logit_scale``, ``qk_ln``, a prefix LM, sequence ids, multi-query attention) runs
only under MosaicML's own remote code, so there is no transformers reference to be at parity with:
it is refused, naming the field.

    transformer.wte.weight                    -> embed.W_E (and the tied unembedding)
    transformer.blocks.{l}.norm_1 / norm_2    -> blocks.{l}.ln1 / ln2 (.w; .b zeros)
    transformer.blocks.{l}.attn.Wqkv [3D, D]  -> blocks.{l}.attn._W_{Q,K,V}_lin (rows q, k, v)
    transformer.blocks.{l}.attn.out_proj      -> blocks.{l}.attn._W_O_lin
    transformer.blocks.{l}.ffn.up_proj / down_proj -> blocks.{l}.mlp._W_in_lin / _W_out_lin
    transformer.norm_f -> ln_final;  lm_head.weight -> unembed._W_U_lin (absent when tied)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig

# attn_config fields transformers' MPT reads or ignores, and the value it behaves as if they had.
_ATTENTION_AS_TRANSFORMERS_RUNS_IT = {"alibi": True, "alibi_bias_max": 8, "qk_ln": False, "prefix_lm": False,
                                      "attn_uses_sequence_id": False, "attn_type": "multihead_attention"}
_MODEL_AS_TRANSFORMERS_RUNS_IT = {"expansion_ratio": 4, "no_bias": True, "logit_scale": None}
_WHY = "transformers' MPT ignores it (only MosaicML's remote code honours it), so there is no reference to match"


def model_config(hf: HFConfig, architecture: str = "MptForCausalLM") -> ModelConfig:
    """Maps an MPT ``config.json`` onto ``ModelConfig``; a value transformers does not honour is refused
    naming its field.

    Example:
        >>> hf = HFConfig({"d_model": 48, "n_heads": 6, "n_layers": 2, "vocab_size": 101, "max_seq_len": 64,
        ...                "attn_config": {"clip_qkv": 2.0}}, "config.json")
        >>> cfg = model_config(hf)
        >>> cfg.positional, cfg.clip_qkv, cfg.d_mlp
        ('alibi', 2.0, 192)
    """
    attention = hf.get("attn_config", {})
    if not isinstance(attention, dict):
        raise hf.refuse("attn_config", attention, "expected a mapping")
    _refuse_what_transformers_ignores(hf, attention)
    d_model, n_heads = int(hf.require("d_model")), int(hf.require("n_heads"))
    softmax_scale = attention.get("softmax_scale")
    clip = attention.get("clip_qkv")
    return hf.model_config(
        n_layers=int(hf.require("n_layers")), d_model=d_model, n_heads=n_heads, d_mlp=4 * d_model,
        d_vocab=int(hf.require("vocab_size")), n_ctx=int(hf.get("max_seq_len", 2048)), normalization="LN",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), positional="alibi", act_fn="gelu",
        attn_scale=None if softmax_scale is None else 1.0 / float(softmax_scale),
        clip_qkv=float(clip) if clip else None,  # transformers skips a clip of 0 as it does None
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _refuse_what_transformers_ignores(hf: HFConfig, attention: dict[str, Any]) -> None:
    for field, expected in _ATTENTION_AS_TRANSFORMERS_RUNS_IT.items():
        if attention.get(field, expected) != expected:
            raise hf.refuse(f"attn_config.{field}", attention[field], _WHY)
    for field, expected in _MODEL_AS_TRANSFORMERS_RUNS_IT.items():
        if hf.get(field, expected) != expected:
            raise hf.refuse(field, hf.get(field), _WHY)


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str = "") -> dict[str, Tensor]:
    """Reads every tensor the model needs under our names (the fused ``Wqkv`` split, zero norm biases);
    a missing or mis-shaped one is a ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-mpt")), cfg)   # doctest: +SKIP
        >>> tensors["blocks.0.ln1.b"].abs().max()   # MPT's norms have no bias        # doctest: +SKIP
        tensor(0.)
    """
    V, D, M = cfg.d_vocab, cfg.d_model, cfg.d_mlp
    out = {"embed.W_E": ckpt.take("transformer.wte.weight", (V, D)),
           **_gain_only_norm(ckpt, "transformer.norm_f", "ln_final", D)}
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    for layer in range(cfg.n_layers):
        hf, ours = f"transformer.blocks.{layer}", f"blocks.{layer}"
        out.update(_gain_only_norm(ckpt, f"{hf}.norm_1", f"{ours}.ln1", D))
        out.update(_gain_only_norm(ckpt, f"{hf}.norm_2", f"{ours}.ln2", D))
        qkv_3DD = ckpt.take(f"{hf}.attn.Wqkv.weight", (3 * D, D))
        for index, name in enumerate("QKV"):
            out[f"{ours}.attn._W_{name}_lin"] = qkv_3DD[index * D:(index + 1) * D]
        out[f"{ours}.attn._W_O_lin"] = ckpt.take(f"{hf}.attn.out_proj.weight", (D, D))
        out[f"{ours}.mlp._W_in_lin"] = ckpt.take(f"{hf}.ffn.up_proj.weight", (M, D))
        out[f"{ours}.mlp._W_out_lin"] = ckpt.take(f"{hf}.ffn.down_proj.weight", (D, M))
    return out


def _gain_only_norm(ckpt: SafetensorsCheckpoint, hf: str, ours: str, D: int) -> dict[str, Tensor]:
    """A bias-free LayerNorm: its gain, and a zero bias in the gain's dtype (a bf16 checkpoint stays bf16)."""
    gain = ckpt.take(f"{hf}.weight", (D,))
    return {f"{ours}.w": gain, f"{ours}.b": torch.zeros(D, dtype=gain.dtype)}


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={"MptForCausalLM": ("mpt", "MPT-7B, MPT-30B (ALiBi, clip_qkv)")},
    model_config=model_config,
    convert_tensors=convert_tensors,
),)
