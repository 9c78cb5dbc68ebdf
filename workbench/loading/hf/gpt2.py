"""GPT-2 in HF format (``GPT2LMHeadModel``).

Legend: D d_model, M d_mlp.

GPT-2 stores its projections as ``Conv1D`` weights, [in, out] -- the transpose of
``nn.Linear``'s [out, in] that we use -- and fuses Q, K and V into one ``c_attn`` of
[D, 3D]. Tensor names (``transformer.`` prefix optional: the original OpenAI upload lacks it):

    wte.weight -> embed.W_E;  wpe.weight -> pos_embed.W_pos;  ln_f -> ln_final
    h.{l}.ln_1 / ln_2              -> blocks.{l}.ln1 / ln2 (.w, .b)
    h.{l}.attn.c_attn (w.T split)  -> blocks.{l}.attn._W_{Q,K,V}_lin (+ _b_{Q,K,V}_lin)
    h.{l}.attn.c_proj (w.T)        -> blocks.{l}.attn._W_O_lin (+ b_O)
    h.{l}.mlp.c_fc / c_proj (w.T)  -> blocks.{l}.mlp._W_in_lin / _W_out_lin (+ b_in / b_out)
    (our names are the nn.Linear-layout storage; W_Q, W_in ... are its TransformerLens views)

``h.{l}.attn.bias`` / ``masked_bias`` in old checkpoints are causal-mask buffers, not weights.
"""

from __future__ import annotations

import re

from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig


def model_config(hf: HFConfig, architecture: str = "GPT2LMHeadModel") -> ModelConfig:
    """Maps a GPT-2 ``config.json`` onto ``ModelConfig``.

    Example:
        >>> hf = HFConfig({"n_embd": 48, "n_head": 6, "n_layer": 2, "vocab_size": 101, "n_positions": 64,
        ...                "activation_function": "gelu_new"}, "config.json")
        >>> model_config(hf).d_mlp
        192
    """
    if not hf.get("scale_attn_weights", True):
        raise hf.refuse("scale_attn_weights", False, "attention scores are always scaled by 1/sqrt(d_head)")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        raise hf.refuse("scale_attn_by_inverse_layer_idx", True, "per-layer score scaling is not supported")
    d_model = int(hf.require("n_embd"))
    return hf.model_config(
        n_layers=int(hf.require("n_layer")), d_model=d_model, n_heads=int(hf.require("n_head")),
        d_mlp=int(hf.get("n_inner", 4 * d_model)), d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.get("n_positions", hf.get("n_ctx", 1024))),
        normalization="LN", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), positional="learned",
        act_fn=hf.activation("activation_function"), attn_bias=True, mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str = "") -> dict[str, Tensor]:
    """Reads every tensor the model needs, transposed and split into our layout; a missing or
    mis-shaped one is a ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("gpt2-dir")), cfg)   # doctest: +SKIP
        >>> tensors["blocks.0.attn._W_Q_lin"].shape   # [d_model, d_model], cut from c_attn.T   # doctest: +SKIP
        torch.Size([768, 768])
    """
    prefix = "transformer." if ckpt.has("transformer.wte.weight") else ""
    take = lambda name, shape: ckpt.take(prefix + name, shape)  # noqa: E731
    V, D, M = cfg.d_vocab, cfg.d_model, cfg.d_mlp
    out = {"embed.W_E": take("wte.weight", (V, D)), "pos_embed.W_pos": take("wpe.weight", (cfg.n_ctx, D)),
           "ln_final.w": take("ln_f.weight", (D,)), "ln_final.b": take("ln_f.bias", (D,))}
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    for layer in range(cfg.n_layers):
        hf, ours = f"h.{layer}", f"blocks.{layer}"
        for hf_ln, our_ln in (("ln_1", "ln1"), ("ln_2", "ln2")):
            out[f"{ours}.{our_ln}.w"] = take(f"{hf}.{hf_ln}.weight", (D,))
            out[f"{ours}.{our_ln}.b"] = take(f"{hf}.{hf_ln}.bias", (D,))
        qkv_3DD = take(f"{hf}.attn.c_attn.weight", (D, 3 * D)).T  # Conv1D [in, out] -> Linear [out, in]
        qkv_bias_3D = take(f"{hf}.attn.c_attn.bias", (3 * D,))
        for index, name in enumerate("QKV"):
            out[f"{ours}.attn._W_{name}_lin"] = qkv_3DD[index * D:(index + 1) * D]
            out[f"{ours}.attn._b_{name}_lin"] = qkv_bias_3D[index * D:(index + 1) * D]
        out[f"{ours}.attn._W_O_lin"] = take(f"{hf}.attn.c_proj.weight", (D, D)).T
        out[f"{ours}.attn.b_O"] = take(f"{hf}.attn.c_proj.bias", (D,))
        out[f"{ours}.mlp._W_in_lin"] = take(f"{hf}.mlp.c_fc.weight", (D, M)).T
        out[f"{ours}.mlp.b_in"] = take(f"{hf}.mlp.c_fc.bias", (M,))
        out[f"{ours}.mlp._W_out_lin"] = take(f"{hf}.mlp.c_proj.weight", (M, D)).T
        out[f"{ours}.mlp.b_out"] = take(f"{hf}.mlp.c_proj.bias", (D,))
    return out


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={"GPT2LMHeadModel": ("gpt2", "GPT-2")},
    model_config=model_config,
    convert_tensors=convert_tensors,
    # Buffers some GPT-2 checkpoints carry that are not parameters (the causal mask).
    ignored_tensors=re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$"),
),)
