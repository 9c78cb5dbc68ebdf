"""DiffLlama in HF format: Llama with differential attention
(``components.differential_attention``).

What differs from Llama (read off transformers 5.24's ``modeling_diffllama.py``): every layer's attention is
differential, with lambda_init = 0.8 - 0.6 * exp(-0.3 * layer) (``differential_lambda_init`` per layer) and
four learned vectors per layer, ``self_attn.lambda_{q1,k1,q2,k2}`` [d_head] -> ``attn.lambda_*``; the value
pairing needs an even num_key_value_heads (transformers refuses odd ones too); attention_dropout must be 0.
The rest (RMSNorm, SwiGLU without biases, attention_bias, RoPE scalings) is Llama's mapping.
"""

from __future__ import annotations

import math
import re

from torch import Tensor

from workbench.config import PER_LAYER_FIELDS, ModelConfig
from workbench.loading.family import Family
from workbench.loading.hf import llama
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig, per_layer_config, per_layer_values
from workbench.loading.hf.llama import Variant

VARIANTS = {"DiffLlamaForCausalLM": Variant(qkv_bias_field="attention_bias", norm_eps=1e-5)}


def lambda_init(layer: int) -> float:
    """DiffLlama's lambda_init of a layer (transformers' ``lambda_init_fn``).

    Example:
        >>> round(lambda_init(0), 4), round(lambda_init(3), 4)
        (0.2, 0.5561)
    """
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


def model_config(hf: HFConfig, architecture: str) -> ModelConfig:
    """Llama's mapping of ``config.json`` plus each layer's ``differential_lambda_init``.

    Example:
        >>> hf = HFConfig({"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
        ...                "num_hidden_layers": 2, "intermediate_size": 80, "vocab_size": 101,
        ...                "max_position_embeddings": 64, "hidden_act": "silu"}, "config.json")
        >>> [round(v, 3) for v in model_config(hf, "DiffLlamaForCausalLM").layer_values("differential_lambda_init")]
        [0.2, 0.356]
    """
    dropout = hf.get("attention_dropout", 0.0) or 0.0
    if float(dropout) > 0:
        raise hf.refuse("attention_dropout", dropout, "differential attention defines no dropout (transformers refuses it too)")
    cfg = llama.model_config(hf, architecture, variants=VARIANTS)
    if cfg.n_key_value_heads % 2:
        raise hf.refuse("num_key_value_heads", cfg.n_key_value_heads, "differential attention pairs the value heads: "
                                                                       "must be even")
    own = {name: getattr(cfg, name) for name in PER_LAYER_FIELDS}
    layers = [{**values, "differential_lambda_init": lambda_init(layer)}
              for layer, values in enumerate(per_layer_values({**own, "layer_overrides": cfg.layer_overrides},
                                                              cfg.n_layers))]
    return cfg.replace(**per_layer_config(layers))


def convert_tensors(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, architecture: str) -> dict[str, Tensor]:
    """Llama's tensors plus each layer's four lambda vectors.

    Example:
        >>> tensors = convert_tensors(SafetensorsCheckpoint(Path("tiny-diffllama")), cfg, "DiffLlamaForCausalLM")  # doctest: +SKIP
    """
    out = llama.convert_tensors(ckpt, cfg, architecture, variants=VARIANTS)
    for layer in range(cfg.n_layers):
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            out[f"blocks.{layer}.attn.{name}"] = ckpt.take(f"model.layers.{layer}.self_attn.{name}", (cfg.d_head,))
    return out


# What loader.py loads through this module (the contract: workbench.loading.family.Family).
FAMILIES = (Family(
    architectures={"DiffLlamaForCausalLM": ("diffllama", "DiffLlama (differential attention: two softmax maps per head)")},
    model_config=model_config,
    convert_tensors=convert_tensors,
    ignored_tensors=re.compile(r".*rotary_emb\.inv_freq$"),
),)
