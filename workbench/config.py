"""``ModelConfig``: the one description of a decoder-only transformer's architecture.

What a built model runs under (dtype, device, kernel, TransformerLens's switches, the weight-processing
record) is not here: see ``workbench.options.RuntimeOptions``. Every architecture the loaders understand (see
``wb.supported_architectures()``) is expressed as values of these fields; components read the config and never
branch on an architecture name.
Defaults that depend on other fields (``d_head``, ``n_key_value_heads``, ``d_mlp``, ``rotary_dim``,
``attn_scale``) are resolved once in ``__post_init__``, so after construction every field holds a
concrete value; purely derived quantities are properties.

Layers that differ (Gemma 2's alternating sliding-window and full attention, Gemma 3's local RoPE
base, SmolLM3's layers without RoPE, GPT-Neo's local layers) say so in ``layer_overrides``: one
mapping per layer of the fields that layer sets differently. ``cfg.for_layer(l)`` is the config
block ``l`` is built from, so a component only ever sees plain values. The allowed values and the checks a
config passes are in ``workbench.config_checks``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from workbench.config_checks import (PER_LAYER_FIELDS, ROTARY_SCALINGS, ActFn, Normalization, NormPlacement,
                                     Positional, QKNorm, SinusoidalStyle, check_model_config,
                                     check_sizes_and_choices)
from workbench.errors import ConfigError
from workbench.sub_configs import SUB_CONFIGS, LatentAttentionConfig, MoEConfig, require

# Re-exported: users import these from here (``from workbench.config import LatentAttentionConfig``).
__all__ = ["ModelConfig", "MoEConfig", "LatentAttentionConfig", "PER_LAYER_FIELDS", "ROTARY_SCALINGS",
           "Normalization", "NormPlacement", "Positional", "QKNorm", "ActFn", "SinusoidalStyle"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer.

    Example:
        >>> cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_key_value_heads=2,
        ...                   d_vocab=100, n_ctx=128, normalization="RMS", positional="rotary",
        ...                   act_fn="silu", gated_mlp=True)
        >>> cfg.d_head, cfg.n_query_groups
        (16, 2)
    """

    n_layers: int
    d_model: int
    n_heads: int
    d_vocab: int
    n_ctx: int
    n_key_value_heads: Optional[int] = None  # None: same as n_heads (multi-head attention)
    d_head: Optional[int] = None  # None: d_model // n_heads, which must then divide exactly
    d_mlp: Optional[int] = None  # None: 4 * d_model
    normalization: Normalization = "LN"
    norm_placement: NormPlacement = "pre"
    norm_eps: float = 1e-5
    positional: Positional = "learned"
    rotary_base: float = 10000.0
    rotary_dim: Optional[int] = None  # None: d_head (full rotary)
    # transformers' RoPE scaling as a mapping: {"rope_type": "linear" | "dynamic" | "llama3" | "yarn",
    # "factor": ..., and that type's own keys (ROTARY_SCALINGS)}; None: unscaled.
    rotary_scaling: Optional[dict[str, Any]] = None
    # TransformerLens's name: rotate adjacent pairs (2i, 2i+1) (GPT-J) instead of halves (i, i + R/2).
    rotary_adjacent_pairs: bool = False
    act_fn: ActFn = "gelu"
    gated_mlp: bool = False
    attn_only: bool = False
    num_experts: int = 0  # 0: a dense MLP; otherwise a top-k mixture of experts (d_mlp is one expert's width)
    experts_per_token: int = 0
    # How the mixture routes and what its experts compute (read where num_experts > 0; layers' own counts
    # may say 0).
    moe: MoEConfig = dataclasses.field(default_factory=lambda: MoEConfig())
    sliding_window: Optional[int] = None  # a query sees the last `sliding_window` keys, itself included
    # TransformerLens's convention: scores are q.k / attn_scale; None: sqrt(d_head) (GPT-Neo: 1.0).
    attn_scale: Optional[float] = None
    attn_scores_soft_cap: Optional[float] = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    # A learned logit per head that joins each softmax but carries no value (gpt-oss): a query's
    # weights over the real keys then sum to less than one.
    attn_sinks: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3) when set; None: standard attention.
    latent: Optional[LatentAttentionConfig] = None
    output_logits_soft_cap: Optional[float] = None  # the same on the logits (Gemma 2)
    # Norm q and k before RoPE: per head ("head": Qwen3, Gemma 3, StableLM, Phi) or over the whole
    # projection ("projection": OLMo 2); the norm kind is ``normalization``. None: no QK norm.
    qk_norm: Optional[QKNorm] = None
    clip_qkv: Optional[float] = None  # q, k and v clamped to [-clip_qkv, clip_qkv] (OLMo)
    # TransformerLens's name: attention and MLP both read the block's input, and both outputs are
    # added to it (GPT-J, GPT-NeoX, Phi-1/2); ln2 then norms the block input for the MLP.
    parallel_attn_mlp: bool = False
    embed_scale: float = 1.0  # token embeddings multiplied by this (Gemma: sqrt(d_model))
    embed_norm: bool = False  # a norm (ln_embed) right after the embeddings (BLOOM)
    tie_embeddings: bool = False
    unembed_bias: bool = False  # a b_U [d_vocab] (TransformerLens's; weight processing may add one)
    attn_bias: bool = False
    mlp_bias: bool = False
    model_name: str = "custom"
    # The unembedding's input multiplied by this (Granite: 1 / logits_scaling; Cohere: logit_scale).
    logits_scale: float = 1.0
    # QK norm after RoPE instead of before (HunYuan).
    qk_norm_after_rotary: bool = False
    # Queries scaled by 1 + beta * log(1 + floor(position / length)) after RoPE (Ministral 3's
    # llama_4_scaling_beta over original_max_position_embeddings); None: no scaling.
    query_scale_beta: Optional[float] = None
    query_scale_length: Optional[int] = None
    # q and k clamped to clip_qkv after their QK norm instead of at the projection (OLMoE; v as before).
    clip_qkv_after_qk_norm: bool = False
    # A query sees only the keys of its own chunk of this many positions (Llama 4's chunked attention); None: all.
    attention_chunk_size: Optional[int] = None
    # The query scaling reads position + this (Llama 4's attention temperature: floor((position + 1) / length)).
    query_scale_position_offset: int = 0
    # Differential attention (DiffLlama) with this lambda_init (one per layer); None: standard attention.
    differential_lambda_init: Optional[float] = None
    # One mapping per layer of the PER_LAYER_FIELDS that layer sets differently; () = all alike.
    layer_overrides: tuple[dict[str, Any], ...] = ()
    # The table of ``positional="sinusoidal"``: "interleaved" (sin, cos) pairs at frequencies 10000^(-2i/D)
    # (Attention Is All You Need), or "fairseq" (XGLM): all sines, then all cosines, at frequencies
    # 10000^(-i/(D/2 - 1)), position p reading the row of p + 2 (fairseq's padding offset).
    sinusoidal_style: SinusoidalStyle = "interleaved"

    def __post_init__(self) -> None:
        check_sizes_and_choices(self)
        if self.d_head is None:
            require(self.d_model % self.n_heads == 0, "d_head",
                    f"not given, and d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
            self._set("d_head", self.d_model // self.n_heads)
        require(self.d_head > 0, "d_head", f"must be positive, got {self.d_head}")
        if self.n_key_value_heads is None:
            self._set("n_key_value_heads", self.n_heads)
        require(0 < self.n_key_value_heads <= self.n_heads and self.n_heads % self.n_key_value_heads == 0,
                "n_key_value_heads",
                f"must divide n_heads={self.n_heads}, got {self.n_key_value_heads}")
        if self.d_mlp is None:
            self._set("d_mlp", 4 * self.d_model)
        require(self.attn_only or self.d_mlp > 0, "d_mlp", f"must be positive, got {self.d_mlp}")
        if self.rotary_dim is None:
            self._set("rotary_dim", self.d_head)
        if self.attn_scale is None:
            self._set("attn_scale", math.sqrt(self.d_head))
        if isinstance(self.layer_overrides, list):  # from JSON
            self._set("layer_overrides", tuple(self.layer_overrides))
        check_model_config(self)

    def for_layer(self, layer: int) -> "ModelConfig":
        """The config block ``layer`` is built from: this one with that layer's ``layer_overrides``.

        Example:
            >>> cfg = ModelConfig(n_layers=2, d_model=8, n_heads=2, d_vocab=10, n_ctx=16,
            ...                   layer_overrides=({"sliding_window": 4}, {}))
            >>> cfg.for_layer(0).sliding_window, cfg.for_layer(1).sliding_window
            (4, None)
        """
        if not self.layer_overrides or not self.layer_overrides[layer]:
            return self if not self.layer_overrides else self.replace(layer_overrides=())
        return self.replace(layer_overrides=(), **self.layer_overrides[layer])

    def layer_values(self, field: str) -> list[Any]:
        """``field`` of every layer, overrides applied.

        Example:
            >>> cfg = ModelConfig(n_layers=2, d_model=8, n_heads=2, d_vocab=10, n_ctx=16,
            ...                   layer_overrides=({"sliding_window": 4}, {}))
            >>> cfg.layer_values("sliding_window")
            [4, None]
        """
        return [self.layer_overrides[layer].get(field, getattr(self, field)) if self.layer_overrides
                else getattr(self, field) for layer in range(self.n_layers)]

    def _set(self, name: str, value: Any) -> None:
        # Frozen dataclass: resolving a default in __post_init__ is the one place we write.
        object.__setattr__(self, name, value)

    # ---- derived values -------------------------------------------------------------------
    @property
    def n_query_groups(self) -> int:
        """Query heads that share one key/value head (1 for MHA, n_heads for MQA)."""
        return self.n_heads // self.n_key_value_heads

    @property
    def has_final_norm(self) -> bool:
        """Post-norm blocks already end in a norm; every other placement has a final one."""
        return self.norm_placement != "post"

    @property
    def context_limit(self) -> Optional[int]:
        """The longest sequence the positions cover: ``n_ctx``, or None where they extend past it.

        Dynamic (NTK) RoPE refits its base to a call that runs past ``n_ctx`` (as `transformers`
        recomputes it per forward), so a model whose every layer has it, or has no positions at all,
        takes longer inputs, as `transformers` does; a learned table or a fixed RoPE table ends at ``n_ctx``.

        Example:
            >>> cfg = ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=16, positional="rotary",
            ...                   rotary_scaling={"rope_type": "dynamic", "factor": 2.0})
            >>> cfg.context_limit, cfg.replace(rotary_scaling=None).context_limit
            (None, 16)
        """
        kinds = [(positional, (scaling or {}).get("rope_type")) for positional, scaling
                 in zip(self.layer_values("positional"), self.layer_values("rotary_scaling"))]
        dynamic = [positional == "rotary" and kind == "dynamic" for positional, kind in kinds]
        if any(dynamic) and all(d or positional == "none" for d, (positional, _) in zip(dynamic, kinds)):
            return None
        return self.n_ctx

    @property
    def rotary_regime_length(self) -> Optional[int]:
        """The longest call (in positions) whose RoPE angles are the short ones, where a longer call
        rotates every position differently: longrope's original_max_position_embeddings (None otherwise).
        A KV cache filled within it no longer matches a call past it, so generation re-runs the prefix there.

        Example:
            >>> cfg = ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=64, positional="rotary",
            ...                   rotary_scaling={"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0, 1.0],
            ...                                   "long_factor": [2.0, 3.0], "original_max_position_embeddings": 16})
            >>> cfg.rotary_regime_length
            16
        """
        lengths = [int(scaling["original_max_position_embeddings"]) for scaling in self.layer_values("rotary_scaling")
                   if scaling and scaling.get("rope_type") == "longrope"]
        return min(lengths) if lengths else None

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return any(n > 0 for n in self.layer_values("num_experts"))

    @property
    def moe_layers(self) -> list[int]:
        """The layers whose MLP is a mixture of experts (DeepSeek's first layers are dense).

        Example:
            >>> cfg = ModelConfig(n_layers=2, d_model=8, n_heads=2, d_vocab=10, n_ctx=16, num_experts=4,
            ...                   experts_per_token=2, layer_overrides=({"num_experts": 0, "experts_per_token": 0}, {}))
            >>> cfg.moe_layers
            [1]
        """
        return [layer for layer, n in enumerate(self.layer_values("num_experts")) if n > 0]

    @property
    def is_latent_attention(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from a cached latent."""
        return self.latent is not None

    @property
    def d_head_v(self) -> int:
        """The value width per head: latent attention's own ``d_head_v``, else ``d_head``.

        Example:
            >>> cfg = ModelConfig(n_layers=1, d_model=32, n_heads=2, d_vocab=10, n_ctx=8, positional="rotary",
            ...                   latent=LatentAttentionConfig(kv_lora_rank=8, d_head_v=12))
            >>> cfg.d_head, cfg.d_head_v
            (16, 12)
        """
        return self.latent.d_head_v if self.latent is not None and self.latent.d_head_v else self.d_head

    @property
    def normalization_type(self) -> str:
        """TransformerLens's name for ``normalization`` (read by ``ActivationCache`` helpers)."""
        return self.normalization

    # ---- (de)serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``from_dict(cfg.to_dict()) == cfg``.

        Example:
            >>> cfg = ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8)
            >>> ModelConfig.from_dict(cfg.to_dict()) == cfg
            True
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """Inverse of ``to_dict``; unknown keys are an error naming them (a saved model's config.json, which
        holds runtime options too, is read by ``workbench.options.split_saved_config``). A dict written before
        the mixture and latent-attention settings had their sub-configs (``router_scoring``, ``kv_lora_rank``
        ... at the top level) reads the same.

        Example:
            >>> old = {"n_layers": 1, "d_model": 8, "n_heads": 2, "d_vocab": 10, "n_ctx": 8,
            ...        "num_experts": 4, "experts_per_token": 2, "router_scoring": "sigmoid"}
            >>> ModelConfig.from_dict(old).moe.router_scoring
            'sigmoid'
        """
        data = dict(data)
        for name, sub_config in SUB_CONFIGS.items():
            fields = {f.name for f in dataclasses.fields(sub_config)}
            flat = {key: data.pop(key) for key in list(data) if key in fields}
            if name == "latent" and flat.get("kv_lora_rank") is None:
                flat = {}  # a dense model's old config: kv_lora_rank null beside the other latent defaults
            if isinstance(data.get(name), dict) or flat:
                data[name] = sub_config(**{**(data.get(name) or {}), **flat})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"ModelConfig: unknown field(s) {unknown}")
        if isinstance(data.get("layer_overrides"), list):  # JSON has no tuples
            data["layer_overrides"] = tuple(data["layer_overrides"])
        return cls(**data)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

