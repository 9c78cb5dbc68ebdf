"""OPT and BLOOM in HF format (``OPTForCausalLM``, ``BloomForCausalLM``).

Legend: H n_heads, K d_head, D d_model, M d_mlp, V d_vocab, F word_embed_proj_dim, L n_layers.

Both are LayerNorm decoders with biased multi-head attention and a plain (ungated) MLP; they
differ in positions, norms and tensor names, which ``Variant`` and the two tensor maps record.

OPT (transformers 5.23 ``modeling_opt.py``): learned positions looked up at ``position + 2``
(fairseq's padding offset; without padding the first two rows are never read, so ``W_pos`` is
rows 2.. of ``embed_positions``), ReLU, ``do_layer_norm_before`` False (OPT-350m) is post-norm
with no final norm. ``word_embed_proj_dim`` F != D adds bias-free ``project_in`` [D, F] after the
token embedding and ``project_out`` [F, D] before ``lm_head`` [V, F]; both are linear maps next to
another linear map, so they are folded in at load time (``W_E = embed_tokens @ project_in.T``,
``W_U = lm_head @ project_out``) and the model is then untied::

    model.decoder.embed_tokens.weight [V, F]         -> embed.W_E (@ project_in.weight.T when F != D)
    model.decoder.embed_positions.weight [n_ctx+2, D] -> pos_embed.W_pos (rows 2..)
    model.decoder.layers.{l}.self_attn_layer_norm    -> blocks.{l}.ln1 (.w, .b; ones/zeros without affine)
    model.decoder.layers.{l}.final_layer_norm        -> blocks.{l}.ln2
    model.decoder.layers.{l}.self_attn.{q,k,v,out}_proj -> blocks.{l}.attn._W_{Q,K,V,O}_lin (+ _b_{Q,K,V}_lin, b_O)
    model.decoder.layers.{l}.fc1 / fc2               -> blocks.{l}.mlp._W_in_lin / _W_out_lin (+ b_in / b_out)
    model.decoder.final_layer_norm                   -> ln_final (pre-norm only)
    lm_head.weight [V, F]                            -> unembed._W_U_lin (@ project_out.weight when F != D;
                                                        absent when tied and F == D)

BLOOM (``modeling_bloom.py``): ALiBi (our ``alibi_slopes`` equal transformers'
``_get_alibi_slopes``, non-powers of two included), a LayerNorm on the embeddings, tanh GELU
(``bloom_gelu_forward`` is the ``gelu_new`` formula), tied ``lm_head``. The fused
``query_key_value`` [3D, D] has its output rows laid out per head as [H, 3, K] (``_reshape``
views them so), so Q, K and V are the [:, 0], [:, 1], [:, 2] slices::

    transformer.word_embeddings.weight               -> embed.W_E
    transformer.word_embeddings_layernorm            -> ln_embed (.w, .b)
    transformer.h.{l}.input_layernorm / post_attention_layernorm -> blocks.{l}.ln1 / ln2
    transformer.h.{l}.self_attention.query_key_value [H*3*K, D] -> blocks.{l}.attn._W_{Q,K,V}_lin (+ biases)
    transformer.h.{l}.self_attention.dense           -> blocks.{l}.attn._W_O_lin (+ b_O)
    transformer.h.{l}.mlp.dense_h_to_4h / dense_4h_to_h -> blocks.{l}.mlp._W_in_lin / _W_out_lin (+ b_in / b_out)
    transformer.ln_f -> ln_final;  lm_head.weight -> unembed._W_U_lin (only when untied)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from workbench.config import ModelConfig
from workbench.errors import CheckpointError
from workbench.loading.family import Family
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig

# OPT looks position p up at row p + 2 of embed_positions (fairseq reserved rows for padding).
OPT_POSITION_OFFSET = 2
# BLOOM has no position table, hence no maximum; the length it was trained at when config.json lacks one.
BLOOM_DEFAULT_N_CTX = 2048


@dataclass(frozen=True)
class Variant:
    """What distinguishes the two architectures, as data rather than branches on a name."""

    config: Callable[[HFConfig], ModelConfig]
    tensors: Callable[[SafetensorsCheckpoint, ModelConfig], dict[str, Tensor]]


def model_config(hf: HFConfig, architecture: str) -> ModelConfig:
    """Maps an OPT or BLOOM ``config.json`` onto ``ModelConfig``; unsupported values name their field.

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "n_head": 6, "n_layer": 2, "vocab_size": 101}, "config.json")
        >>> cfg = model_config(hf, "BloomForCausalLM")
        >>> cfg.positional, cfg.embed_norm, cfg.n_ctx
        ('alibi', True, 2048)
    """
    return VARIANTS[architecture].config(hf)


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str) -> dict[str, Tensor]:
    """Reads every tensor the model needs, renamed, split and folded into our layout; a missing or
    mis-shaped one is a ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-opt")), cfg, "OPTForCausalLM")  # doctest: +SKIP
        >>> tensors["pos_embed.W_pos"].shape   # [n_ctx, D]: the two offset rows dropped   # doctest: +SKIP
        torch.Size([64, 48])
    """
    return VARIANTS[architecture].tensors(ckpt, cfg)


# ---- OPT ---------------------------------------------------------------------------------------
def opt_config(hf: HFConfig) -> ModelConfig:
    """``ModelConfig`` of an OPT ``config.json``.

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "num_attention_heads": 6, "num_hidden_layers": 2, "ffn_dim": 80,
        ...                "vocab_size": 101, "max_position_embeddings": 64, "do_layer_norm_before": False,
        ...                "word_embed_proj_dim": 32, "activation_function": "relu"}, "config.json")
        >>> cfg = opt_config(hf)
        >>> cfg.norm_placement, cfg.tie_embeddings
        ('post', False)
    """
    d_model = int(hf.require("hidden_size"))
    pre_norm = bool(hf.get("do_layer_norm_before", True))
    if pre_norm and hf.get("_remove_final_layer_norm", False):
        raise hf.refuse("_remove_final_layer_norm", True, "a pre-norm model without a final norm is not supported")
    # project_in/out are folded into W_E and W_U, which then differ even when lm_head is tied.
    projected = int(hf.get("word_embed_proj_dim", d_model)) != d_model
    bias = bool(hf.get("enable_bias", True))
    return hf.model_config(
        n_layers=int(hf.require("num_hidden_layers")), d_model=d_model,
        n_heads=int(hf.require("num_attention_heads")), d_mlp=int(hf.require("ffn_dim")),
        d_vocab=int(hf.require("vocab_size")), n_ctx=int(hf.require("max_position_embeddings")),
        normalization="LN", norm_eps=1e-5,  # nn.LayerNorm's default: OPT's config has no epsilon
        norm_placement="pre" if pre_norm else "post", positional="learned",
        act_fn=hf.activation("activation_function"), attn_bias=bias, mlp_bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)) and not projected,
    )


def opt_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig) -> dict[str, Tensor]:
    """OPT's tensors in our names, the offset position rows dropped and the projections folded in."""
    D, M = cfg.d_model, cfg.d_mlp
    prefix = "model.decoder"
    out = _opt_embeddings(ckpt, cfg, prefix)
    dtype = out["embed.W_E"].dtype
    # layer_norm_elementwise_affine False: no norm tensors at all; otherwise every norm has both.
    affine = ckpt.has(f"{prefix}.layers.0.self_attn_layer_norm.weight")
    norm = lambda hf, ours: _layer_norm(ckpt, hf, ours, D, dtype, affine)  # noqa: E731
    if cfg.has_final_norm:
        out.update(norm(f"{prefix}.final_layer_norm", "ln_final"))
    for layer in range(cfg.n_layers):
        hf, ours = f"{prefix}.layers.{layer}", f"blocks.{layer}"
        out.update(norm(f"{hf}.self_attn_layer_norm", f"{ours}.ln1"))
        out.update(norm(f"{hf}.final_layer_norm", f"{ours}.ln2"))
        for proj, name in (("q", "Q"), ("k", "K"), ("v", "V"), ("out", "O")):
            out[f"{ours}.attn._W_{name}_lin"] = ckpt.take(f"{hf}.self_attn.{proj}_proj.weight", (D, D))
            if cfg.attn_bias:
                ours_bias = f"{ours}.attn.b_O" if name == "O" else f"{ours}.attn._b_{name}_lin"
                out[ours_bias] = ckpt.take(f"{hf}.self_attn.{proj}_proj.bias", (D,))
        for fc, name, shape in (("fc1", "in", (M, D)), ("fc2", "out", (D, M))):
            out[f"{ours}.mlp._W_{name}_lin"] = ckpt.take(f"{hf}.{fc}.weight", shape)
            if cfg.mlp_bias:
                out[f"{ours}.mlp.b_{name}"] = ckpt.take(f"{hf}.{fc}.bias", shape[:1])
    return out


def _opt_embeddings(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, prefix: str) -> dict[str, Tensor]:
    """W_E, W_pos and (when untied) W_U, with project_in / project_out folded in when F != D."""
    V, D = cfg.d_vocab, cfg.d_model
    embed_VF = _embed_tokens(ckpt, f"{prefix}.embed_tokens.weight", V)
    F = embed_VF.shape[1]  # word_embed_proj_dim, as the checkpoint stores it
    positions = ckpt.take(f"{prefix}.embed_positions.weight", (cfg.n_ctx + OPT_POSITION_OFFSET, D))
    out = {"embed.W_E": embed_VF, "pos_embed.W_pos": positions[OPT_POSITION_OFFSET:]}
    if F == D:
        out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
        return out
    # A tied lm_head is not saved (it is embed_tokens); an untied one is.
    lm_head_VF = ckpt.take("lm_head.weight", (V, F)) if ckpt.has("lm_head.weight") else embed_VF
    out["embed.W_E"] = _fold(embed_VF, ckpt.take(f"{prefix}.project_in.weight", (D, F)).T)
    out["unembed._W_U_lin"] = _fold(lm_head_VF, ckpt.take(f"{prefix}.project_out.weight", (F, D)))
    return out


def _fold(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` computed in float32 (a bf16 checkpoint's product rounded once, at the end)."""
    return (a.float() @ b.float()).to(a.dtype)


def _embed_tokens(ckpt: SafetensorsCheckpoint, name: str, V: int) -> Tensor:
    """OPT's token embedding [V, F]; its width F is word_embed_proj_dim, read off the tensor itself."""
    embed = ckpt.take(name)
    if embed.ndim != 2 or embed.shape[0] != V:
        raise CheckpointError(f"{ckpt.file_of[name]}: tensor '{name}' has shape {tuple(embed.shape)}, "
                              f"expected ({V}, word_embed_proj_dim)")
    return embed


def _layer_norm(ckpt: SafetensorsCheckpoint, hf: str, ours: str, D: int, dtype: torch.dtype,
                affine: bool) -> dict[str, Tensor]:
    """A LayerNorm's gain and bias; without ``affine``, ones and zeros (the identity affine map),
    in the checkpoint's dtype so a bf16 checkpoint stays all bf16."""
    if not affine:
        return {f"{ours}.w": torch.ones(D, dtype=dtype), f"{ours}.b": torch.zeros(D, dtype=dtype)}
    return {f"{ours}.w": ckpt.take(f"{hf}.weight", (D,)), f"{ours}.b": ckpt.take(f"{hf}.bias", (D,))}


# ---- BLOOM -------------------------------------------------------------------------------------
def bloom_config(hf: HFConfig) -> ModelConfig:
    """``ModelConfig`` of a BLOOM ``config.json`` (``n_embed`` is the older spelling of ``hidden_size``).

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "n_head": 6, "n_layer": 2, "vocab_size": 101,
        ...                "apply_residual_connection_post_layernorm": True}, "config.json")
        >>> bloom_config(hf)
        Traceback (most recent call last):
        ...
        workbench.errors.ConfigError: config.json: field 'apply_residual_connection_post_layernorm' = True ...
    """
    if hf.get("apply_residual_connection_post_layernorm", False):
        raise hf.refuse("apply_residual_connection_post_layernorm", True,
                        "the residual taken after the norm (x -> ln(x) + f(ln(x))) is not supported")
    d_model = int(_either(hf, "hidden_size", "n_embed"))
    return hf.model_config(
        n_layers=int(_either(hf, "n_layer", "num_hidden_layers")), d_model=d_model,
        n_heads=int(_either(hf, "n_head", "num_attention_heads")),
        d_mlp=4 * d_model, d_vocab=int(hf.require("vocab_size")),
        n_ctx=int(hf.get("seq_length", BLOOM_DEFAULT_N_CTX)),
        normalization="LN", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), positional="alibi",
        embed_norm=True, act_fn="gelu_new", attn_bias=True, mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _either(hf: HFConfig, field: str, other_spelling: str):
    """``field``'s value, else ``other_spelling``'s; a ``ConfigError`` naming ``field`` when both are absent."""
    value = hf.get(field, hf.get(other_spelling))
    return hf.require(field) if value is None else value


def bloom_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig) -> dict[str, Tensor]:
    """BLOOM's tensors in our names, the per-head fused QKV split ([H, 3, K] output rows)."""
    V, D, M, H, K = cfg.d_vocab, cfg.d_model, cfg.d_mlp, cfg.n_heads, cfg.d_head
    # Some uploads (bigscience/bloom-560m) store the base model's names without "transformer.".
    prefix = "transformer." if ckpt.has("transformer.word_embeddings.weight") else ""
    take = lambda name, shape: ckpt.take(prefix + name, shape)  # noqa: E731
    out = {"embed.W_E": take("word_embeddings.weight", (V, D)),
           "ln_embed.w": take("word_embeddings_layernorm.weight", (D,)),
           "ln_embed.b": take("word_embeddings_layernorm.bias", (D,)),
           "ln_final.w": take("ln_f.weight", (D,)), "ln_final.b": take("ln_f.bias", (D,))}
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    for layer in range(cfg.n_layers):
        hf, ours = f"h.{layer}", f"blocks.{layer}"
        for hf_ln, our_ln in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")):
            out[f"{ours}.{our_ln}.w"] = take(f"{hf}.{hf_ln}.weight", (D,))
            out[f"{ours}.{our_ln}.b"] = take(f"{hf}.{hf_ln}.bias", (D,))
        qkv_H3KD = take(f"{hf}.self_attention.query_key_value.weight", (3 * D, D)).view(H, 3, K, D)
        qkv_H3K = take(f"{hf}.self_attention.query_key_value.bias", (3 * D,)).view(H, 3, K)
        for index, name in enumerate("QKV"):
            out[f"{ours}.attn._W_{name}_lin"] = qkv_H3KD[:, index].reshape(H * K, D)
            out[f"{ours}.attn._b_{name}_lin"] = qkv_H3K[:, index].reshape(H * K)
        out[f"{ours}.attn._W_O_lin"] = take(f"{hf}.self_attention.dense.weight", (D, D))
        out[f"{ours}.attn.b_O"] = take(f"{hf}.self_attention.dense.bias", (D,))
        out[f"{ours}.mlp._W_in_lin"] = take(f"{hf}.mlp.dense_h_to_4h.weight", (M, D))
        out[f"{ours}.mlp.b_in"] = take(f"{hf}.mlp.dense_h_to_4h.bias", (M,))
        out[f"{ours}.mlp._W_out_lin"] = take(f"{hf}.mlp.dense_4h_to_h.weight", (D, M))
        out[f"{ours}.mlp.b_out"] = take(f"{hf}.mlp.dense_4h_to_h.bias", (D,))
    return out


VARIANTS = {
    "OPTForCausalLM": Variant(config=opt_config, tensors=opt_tensors),
    "BloomForCausalLM": Variant(config=bloom_config, tensors=bloom_tensors),
}


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={
        "OPTForCausalLM": ("opt", "OPT (pre-norm and OPT-350m's post-norm with word_embed_proj_dim)"),
        "BloomForCausalLM": ("bloom", "BLOOM, BLOOMZ"),
    },
    model_config=model_config,
    convert_tensors=convert_tensors,
),)
