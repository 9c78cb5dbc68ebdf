"""CodeGen in HF format (``CodeGenForCausalLM``: Salesforce CodeGen 1 mono/multi/nl), read off
transformers 5.24's ``modeling_codegen.py``.

Legend: H n_heads, K d_head, D d_model, M d_mlp, V d_vocab.

CodeGen is GPT-J with another tensor layout: the same config fields with the same meaning (partial
RoPE over adjacent pairs of the first ``rotary_dim`` dimensions, base 10000; a parallel block with
ONE norm read by attention and MLP; bias-free attention, a biased MLP and a biased unembedding), so
``neox``'s GPT-J mapping gives its ``ModelConfig``. Its Q, K and V are fused in ``qkv_proj``
[3D, D] as CodeGen was trained on 4 model-parallel shards: transformers views the output as
[4 shards, 3, D/4] with the three parts in the order query, VALUE, key, and each part's 4 shards
side by side make its D = H*K rows.

    transformer.wte.weight                  -> embed.W_E
    transformer.h.{l}.ln_1                  -> blocks.{l}.ln1 and ln2 (two clones of one norm)
    transformer.h.{l}.attn.qkv_proj [3D, D] -> blocks.{l}.attn._W_{Q,K,V}_lin
    transformer.h.{l}.attn.out_proj         -> blocks.{l}.attn._W_O_lin
    transformer.h.{l}.mlp.fc_in / fc_out    -> blocks.{l}.mlp._W_in_lin / _W_out_lin (+ b_in / b_out)
    transformer.ln_f -> ln_final;  lm_head.weight / bias -> unembed._W_U_lin / b_U
"""

from __future__ import annotations

import re

from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf import neox
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig
from workbench.loading.hf.parts import layer_norm, plain_mlp, shared_layer_norm

MODEL_PARALLEL_SHARDS = 4  # transformers' CodeGenAttention.mp_num: the fused rows' interleaving
_SHARD_PARTS = "QVK"  # the order of the three parts inside each shard


def model_config(hf: HFConfig, architecture: str = "CodeGenForCausalLM") -> ModelConfig:
    """Maps a CodeGen ``config.json`` onto ``ModelConfig`` (GPT-J's mapping: the same fields).

    Example:
        >>> hf = HFConfig({"n_embd": 48, "n_head": 6, "n_layer": 2, "vocab_size": 101, "n_positions": 64,
        ...                "rotary_dim": 4, "activation_function": "gelu_new"}, "config.json")
        >>> cfg = model_config(hf)
        >>> cfg.rotary_dim, cfg.rotary_adjacent_pairs, cfg.parallel_attn_mlp, cfg.unembed_bias
        (4, True, True, True)
    """
    d_model = int(hf.require("n_embd"))
    if d_model % MODEL_PARALLEL_SHARDS:
        raise hf.refuse("n_embd", d_model, f"CodeGen's fused qkv_proj is split into {MODEL_PARALLEL_SHARDS} shards")
    return neox.model_config(hf, "GPTJForCausalLM")


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str = "") -> dict[str, Tensor]:
    """Reads every tensor the model needs under our names, the sharded ``qkv_proj`` unpicked; a missing
    or mis-shaped one is a ``CheckpointError`` naming the HF tensor and its file.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-codegen")), cfg)   # doctest: +SKIP
        >>> tensors["blocks.0.attn._W_V_lin"].shape                                      # doctest: +SKIP
        torch.Size([48, 48])
    """
    V, D, M = cfg.d_vocab, cfg.d_model, cfg.d_mlp
    out = {"embed.W_E": ckpt.take("transformer.wte.weight", (V, D)),
           **layer_norm(ckpt, "transformer.ln_f", "ln_final", D),
           "unembed.b_U": ckpt.take("lm_head.bias", (V,))}
    out.update(ckpt.take_unembedding("lm_head.weight", (V, D), cfg.tie_embeddings))
    for layer in range(cfg.n_layers):
        hf, ours = f"transformer.h.{layer}", f"blocks.{layer}"
        out.update(shared_layer_norm(ckpt, f"{hf}.ln_1", ours, D))
        # [shards, 3 parts, D/shards, D]: each part's shards side by side are its D rows
        sharded = ckpt.take(f"{hf}.attn.qkv_proj.weight", (3 * D, D)).view(MODEL_PARALLEL_SHARDS, 3, -1, D)
        for index, name in enumerate(_SHARD_PARTS):
            out[f"{ours}.attn._W_{name}_lin"] = sharded[:, index].reshape(D, D)
        out[f"{ours}.attn._W_O_lin"] = ckpt.take(f"{hf}.attn.out_proj.weight", (D, D))
        out.update(plain_mlp(ckpt, f"{hf}.mlp.fc_in", f"{hf}.mlp.fc_out", f"{ours}.mlp", D, M, bias=True))
    return out


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={"CodeGenForCausalLM": ("codegen", "CodeGen 1 (mono, multi, nl)")},
    model_config=model_config,
    convert_tensors=convert_tensors,
    # Causal-mask buffers older checkpoints carry: not parameters.
    ignored_tensors=re.compile(r"transformer\.h\.\d+\.attn\.(causal_mask|masked_bias|bias)"),
),)
