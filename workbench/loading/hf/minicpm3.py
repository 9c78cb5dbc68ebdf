"""MiniCPM3 in HF format: DeepSeek-V2's multi-head latent attention with RoPE on halves, a dense
SwiGLU MLP in every layer, and three multipliers.

What the config values mean (read off transformers 5.24's ``modeling_minicpm3.py``):

    attention   as ``deepseek``'s (q_lora_rank, kv_lora_rank, qk_nope_head_dim + qk_rope_head_dim,
                v_head_dim; null: hidden_size / heads), RoPE over qk_rope_head_dim on halves; the scores'
                scale 1/sqrt(d_head) times mscale(factor, mscale_all_dim)^2 with a scaled RoPE; latent
                norms at RMSNorm's default eps 1e-6
    scale_emb   the embeddings' multiplier (``embed_scale``)
    scale_depth each sublayer's output times scale_depth / sqrt(num_hidden_layers) before the residual add:
                folded into W_O, b_O, W_out and b_out on loading, as Granite's residual_multiplier
    dim_model_base  the final residual times dim_model_base / hidden_size before lm_head (``logits_scale``)

HF tensor names: ``deepseek.latent_attention_tensors``; mlp.{gate,up,down}_proj; norms, embeddings and
lm_head (tied by default) as Llama's.
"""

from __future__ import annotations

import json
import math
import re

from torch import Tensor

from workbench.config import LatentAttentionConfig, ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig
from workbench.loading.hf.deepseek import LATENT_NORM_EPS, latent_decoder_tensors, mscale_squared

# transformers' defaults for fields missing from config.json, where they matter.
DEFAULTS = {"kv_lora_rank": 256, "q_lora_rank": 768, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "scale_emb": 12,
            "scale_depth": 1.4, "dim_model_base": 256, "tie_word_embeddings": True}
_OUTPUT_WEIGHTS = re.compile(r"blocks\.\d+\.(attn\._W_O_lin|attn\.b_O|mlp\._W_out_lin|mlp\.b_out)")


def model_config(hf: HFConfig, architecture: str) -> ModelConfig:
    """Maps a MiniCPM3 ``config.json`` onto ``ModelConfig``; values we cannot honour name their field.

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "num_attention_heads": 4, "num_hidden_layers": 2,
        ...                "intermediate_size": 80, "vocab_size": 101, "max_position_embeddings": 64,
        ...                "hidden_act": "silu", "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8,
        ...                "qk_rope_head_dim": 4, "scale_emb": 3.0, "dim_model_base": 24}, "config.json")
        >>> cfg = model_config(hf, "MiniCPM3ForCausalLM")
        >>> cfg.d_head, cfg.d_head_v, cfg.embed_scale, cfg.logits_scale
        (12, 12, 3.0, 0.5)
    """
    # A null field takes transformers' default, except q_lora_rank, whose null means "no query bottleneck", and the
    # multipliers, whose null is a multiplier of one.
    kept = ("q_lora_rank", "scale_depth", "dim_model_base")
    hf = HFConfig({**DEFAULTS, **{k: v for k, v in hf.data.items() if v is not None or k in kept}}, hf.source)
    d_model, n_heads = int(hf.require("hidden_size")), int(hf.require("num_attention_heads"))
    residual_scale(hf, int(hf.require("num_hidden_layers")))  # checked before any weight is read
    n_kv = int(hf.get("num_key_value_heads", n_heads))
    if n_kv != n_heads:
        raise hf.refuse("num_key_value_heads", n_kv,
                        f"latent attention expands keys and values for every head: must equal num_attention_heads={n_heads}")
    nope, rope = int(hf.require("qk_nope_head_dim")), int(hf.require("qk_rope_head_dim"))
    rotary = hf.rotary(rope)
    q_lora_rank = hf.get("q_lora_rank")
    return hf.model_config(
        n_layers=int(hf.require("num_hidden_layers")), d_model=d_model, n_heads=n_heads, n_key_value_heads=n_heads,
        d_head=nope + rope, d_mlp=int(hf.require("intermediate_size")),
        latent=LatentAttentionConfig(kv_lora_rank=int(hf.require("kv_lora_rank")),
                                     d_head_v=int(hf.get("v_head_dim") or d_model // n_heads),
                                     q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
                                     latent_norm_eps=LATENT_NORM_EPS),
        attn_scale=math.sqrt(nope + rope) / mscale_squared(rotary["rotary_scaling"]),
        d_vocab=int(hf.require("vocab_size")), n_ctx=int(hf.require("max_position_embeddings")),
        normalization="RMS", norm_eps=float(hf.get("rms_norm_eps", 1e-5)), act_fn=hf.activation("hidden_act"),
        gated_mlp=True, attn_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings")), embed_scale=float(hf.get("scale_emb")),
        logits_scale=float(hf.get("dim_model_base") or d_model) / d_model, **rotary,
    )


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str) -> dict[str, Tensor]:
    """Reads every tensor the model needs, renamed to ours, scale_depth / sqrt(layers) folded into each
    sublayer's output weights and biases.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-minicpm3")), cfg, "MiniCPM3ForCausalLM")  # doctest: +SKIP
    """
    out = latent_decoder_tensors(ckpt, cfg, architecture)
    source = ckpt.directory / "config.json"  # the file model_config read; the scale is not a ModelConfig value
    scale = residual_scale(HFConfig(json.loads(source.read_text()), str(source)), cfg.n_layers)
    return {name: t * scale if _OUTPUT_WEIGHTS.fullmatch(name) else t for name, t in out.items()}


def residual_scale(hf: HFConfig, n_layers: int) -> float:
    """scale_depth / sqrt(num_hidden_layers) (null scale_depth: sqrt(layers), a scale of one, as transformers reads it).

    Example:
        >>> residual_scale(HFConfig({"scale_depth": 1.4}, "config.json"), 4)
        0.7
    """
    depth = {**DEFAULTS, **hf.data}.get("scale_depth")
    if depth is None:
        return 1.0
    if isinstance(depth, bool) or not isinstance(depth, (int, float)):
        raise hf.refuse("scale_depth", depth, "expected a number")
    return float(depth) / math.sqrt(n_layers)


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={"MiniCPM3ForCausalLM": ("minicpm3", "MiniCPM3 (latent attention, scaled embeddings and residuals)")},
    model_config=model_config,
    convert_tensors=convert_tensors,
    ignored_tensors=re.compile(r".*rotary_emb\.inv_freq$"),
),)
