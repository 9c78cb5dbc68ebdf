"""``ModelConfig``: the one description of a decoder-only transformer's architecture.

What a built model runs under (dtype, device, kernel, TransformerLens's switches, the weight-processing
record) is not here: see ``workbench.options.RuntimeOptions``. Every architecture the loaders understand (see ``wb.supported_architectures()``) is expressed as
values of these fields; components read the config and never branch on an architecture name.
Defaults that depend on other fields (``d_head``, ``n_key_value_heads``, ``d_mlp``, ``rotary_dim``,
``attn_scale``) are resolved once in ``__post_init__``, so after construction every field holds a
concrete value; purely derived quantities are properties.

Layers that differ (Gemma 2's alternating sliding-window and full attention, Gemma 3's local RoPE
base, SmolLM3's layers without RoPE, GPT-Neo's local layers) say so in ``layer_overrides``: one
mapping per layer of the fields that layer sets differently. ``cfg.for_layer(l)`` is the config
block ``l`` is built from, so a component only ever sees plain values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, Optional, get_args

from workbench.errors import ConfigError
from workbench.sub_configs import SUB_CONFIGS, LatentAttentionConfig, MoEConfig, require

Normalization = Literal["LN", "RMS"]
# pre: x + f(norm(x)); post: norm(x + f(x)) (the original transformer); sandwich: x + norm'(f(norm(x)))
# (Gemma 2/3); sublayer_output: x + norm'(f(x)) (OLMo 2). norm' is ln1_post / ln2_post.
NormPlacement = Literal["pre", "post", "sandwich", "sublayer_output"]
Positional = Literal["rotary", "learned", "sinusoidal", "alibi", "none"]
QKNorm = Literal["head", "projection"]
# relu2: relu(x)^2 (Nemotron, Arcee); xielu: Apertus's, with learned scalars per layer (dense MLPs only)
ActFn = Literal["gelu", "gelu_new", "silu", "relu", "relu2", "xielu"]
# issue 38 (older dense families): the sinusoidal position table's layout (see ModelConfig.sinusoidal_style).
SinusoidalStyle = Literal["interleaved", "fairseq"]
# The allowed values of each choice field: read off its Literal, so they are written down once.
_CHOICES: dict[str, tuple[str, ...]] = {
    "normalization": get_args(Normalization),
    "norm_placement": get_args(NormPlacement),
    "positional": get_args(Positional),
    "act_fn": get_args(ActFn),
    "sinusoidal_style": get_args(SinusoidalStyle),
}
# RoPE scalings (transformers' rope_type values) and the keys each one needs besides "factor".
ROTARY_SCALINGS: dict[str, tuple[str, ...]] = {
    "linear": (),
    "dynamic": (),
    "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
    # Phi-3/3.5's: per-frequency divisors, short_factor while a call's positions stay within
    # original_max_position_embeddings and long_factor beyond, cos and sin times an attention factor.
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
# Fields a layer may set differently from the model (``layer_overrides``).
# Dense layers among mixture-of-experts ones (DeepSeek's first_k_dense_replace, Qwen2-MoE's
# mlp_only_layers) set num_experts and experts_per_token to 0 and their own d_mlp.
PER_LAYER_FIELDS = ("sliding_window", "positional", "rotary_base", "rotary_scaling", "rotary_dim",
                    "num_experts", "experts_per_token", "d_mlp",
                    # issue 38 (Llama 4): chunked attention, the QK norm and the query scaling on some layers only
                    "attention_chunk_size", "qk_norm", "query_scale_beta", "query_scale_length",
                    "differential_lambda_init")


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
    # ---- issue 38, modern Llama-like families (famb) ------------------------------------------
    # The unembedding's input multiplied by this (Granite: 1 / logits_scaling; Cohere: logit_scale).
    logits_scale: float = 1.0
    # QK norm after RoPE instead of before (HunYuan).
    qk_norm_after_rotary: bool = False
    # Queries scaled by 1 + beta * log(1 + floor(position / length)) after RoPE (Ministral 3's
    # llama_4_scaling_beta over original_max_position_embeddings); None: no scaling.
    query_scale_beta: Optional[float] = None
    query_scale_length: Optional[int] = None
    # ---- end of issue 38 (famb) ---------------------------------------------------------------
    # ---- issue 38, more mixtures of experts (fam-rest) ----------------------------------------
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
    # ---- issue 38, older dense families (Falcon, StarCoder, MPT, CodeGen, XGLM, OpenAI GPT) --------------
    # The table of ``positional="sinusoidal"``: "interleaved" (sin, cos) pairs at frequencies 10000^(-2i/D)
    # (Attention Is All You Need), or "fairseq" (XGLM): all sines, then all cosines, at frequencies
    # 10000^(-i/(D/2 - 1)), position p reading the row of p + 2 (fairseq's padding offset).
    sinusoidal_style: SinusoidalStyle = "interleaved"

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "d_vocab", "n_ctx"):
            require(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name,
                    f"must be a positive integer, got {getattr(self, name)!r}")
        for name, choices in _CHOICES.items():
            require(getattr(self, name) in choices, name,
                    f"must be one of {choices}, got {getattr(self, name)!r}")

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
        require(self.attn_scale > 0, "attn_scale", f"must be positive, got {self.attn_scale}")
        for name in ("attn_scores_soft_cap", "output_logits_soft_cap", "clip_qkv"):
            value = getattr(self, name)
            require(value is None or value > 0, name, f"must be positive or None, got {value!r}")
        require(self.qk_norm in (None, "head", "projection"), "qk_norm",
                f"must be None, 'head' or 'projection', got {self.qk_norm!r}")
        require(self.embed_scale > 0, "embed_scale", f"must be positive, got {self.embed_scale}")
        self._check_famb_fields()
        _check_rotary_scaling(self.rotary_scaling, self.rotary_dim)
        require(not (self.parallel_attn_mlp and self.norm_placement != "pre"), "parallel_attn_mlp",
                f"needs norm_placement='pre', got {self.norm_placement!r}")
        require(not (self.parallel_attn_mlp and self.attn_only), "parallel_attn_mlp",
                "an attention-only model has no MLP to run in parallel")
        require(0 < self.rotary_dim <= self.d_head and self.rotary_dim % 2 == 0, "rotary_dim",
                f"must be even and at most d_head={self.d_head}, got {self.rotary_dim}")
        require(self.rotary_base > 0, "rotary_base", f"must be positive, got {self.rotary_base}")
        require(self.norm_eps > 0, "norm_eps", f"must be positive, got {self.norm_eps}")
        require(self.num_experts >= 0, "num_experts", f"must be >= 0, got {self.num_experts}")
        if self.num_experts:
            require(0 < self.experts_per_token <= self.num_experts, "experts_per_token",
                    f"must be in 1..num_experts={self.num_experts}, got {self.experts_per_token}")
            require(not self.attn_only, "num_experts", "an attention-only model has no MLP to make a mixture of")
        else:
            require(self.experts_per_token == 0, "experts_per_token",
                    f"is {self.experts_per_token} but num_experts is 0 (no mixture of experts)")
        self._check_router()
        self._check_latent_attention()
        if self.sliding_window is not None:
            require(isinstance(self.sliding_window, int) and self.sliding_window > 0, "sliding_window",
                    f"must be a positive integer or None, got {self.sliding_window!r}")
        self._check_layer_overrides()

    def _check_famb_fields(self) -> None:
        """Issue 38's values: a positive logits scale; a query scaling needs both its beta and its length."""
        require(self.logits_scale > 0, "logits_scale", f"must be positive, got {self.logits_scale!r}")
        require(self.act_fn != "xielu" or not (self.gated_mlp or self.num_experts), "act_fn",
                "'xielu' is supported in dense MLPs without a gate only")
        beta, length = self.query_scale_beta, self.query_scale_length
        require((beta is None) == (length is None), "query_scale_beta",
                f"and query_scale_length must be set together, got {beta!r} and {length!r}")
        require(length is None or (isinstance(length, int) and length > 0), "query_scale_length",
                f"must be a positive integer or None, got {length!r}")
        require(self.differential_lambda_init is None or (self.n_key_value_heads % 2 == 0 and self.n_heads % 2 == 0
                and self.latent is None), "differential_lambda_init",
                "needs an even number of query and key/value heads (they pair up) and standard attention")
        chunk = self.attention_chunk_size
        require(chunk is None or (isinstance(chunk, int) and chunk > 0), "attention_chunk_size",
                f"must be a positive integer or None, got {chunk!r}")

    def _check_router(self) -> None:
        """What the mixture's settings (each checked by ``MoEConfig``) must agree on with the expert count."""
        require(isinstance(self.moe, MoEConfig), "moe", f"must be a MoEConfig, got {self.moe!r}")
        require(self.moe.router_scoring != "sparsemixer" or not self.num_experts or self.experts_per_token == 2,
                "experts_per_token", f"must be 2 with sparsemixer routing, got {self.experts_per_token}")
        groups, topk_groups = self.moe.router_groups, self.moe.router_topk_groups
        if groups is None or not self.num_experts:
            return
        per_group = self.num_experts // groups
        require(self.num_experts % groups == 0, "moe.router_groups",
                f"must divide num_experts={self.num_experts}, got {groups}")
        require(self.moe.router_group_score != "top2_sum" or per_group >= 2, "moe.router_group_score",
                f"'top2_sum' needs at least two experts per group, got {per_group}")
        require(self.experts_per_token <= topk_groups * per_group, "experts_per_token",
                f"is {self.experts_per_token} but the {topk_groups} chosen group(s) hold only "
                f"{topk_groups * per_group} experts")

    def _check_latent_attention(self) -> None:
        if self.latent is None:
            return
        require(isinstance(self.latent, LatentAttentionConfig), "latent",
                f"must be a LatentAttentionConfig or None, got {self.latent!r}")
        require(self.positional == "rotary", "latent", f"latent attention needs positional='rotary', got "
                                                       f"{self.positional!r}")
        require(self.n_key_value_heads == self.n_heads, "n_key_value_heads",
                f"latent attention expands keys and values for every head: must equal n_heads={self.n_heads}, "
                f"got {self.n_key_value_heads}")
        for name in ("qk_norm", "clip_qkv"):
            require(getattr(self, name) is None, name, "is not supported with latent attention (latent)")

    def _check_layer_overrides(self) -> None:
        overrides = self.layer_overrides
        if isinstance(overrides, list):  # from JSON
            overrides = tuple(overrides)
            self._set("layer_overrides", overrides)
        if not overrides:
            return
        require(len(overrides) == self.n_layers, "layer_overrides",
                f"must have one mapping per layer ({self.n_layers}), got {len(overrides)}")
        for layer, override in enumerate(overrides):
            unknown = sorted(set(override) - set(PER_LAYER_FIELDS))
            require(not unknown, "layer_overrides",
                    f"layer {layer} sets {unknown}; a layer may set only {PER_LAYER_FIELDS}")
            if "positional" in override:
                require({override["positional"], self.positional} <= {"rotary", "none"}, "layer_overrides",
                        f"layer {layer}: a layer may only switch between 'rotary' and 'none' positions "
                        f"(the model's is {self.positional!r}, the layer's {override['positional']!r})")
            self.for_layer(layer)  # validates the layer's values

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


def _check_rotary_scaling(scaling: Optional[dict[str, Any]], rotary_dim: Optional[int] = None) -> None:
    if scaling is None:
        return
    require(isinstance(scaling, dict), "rotary_scaling", f"must be a mapping or None, got {scaling!r}")
    kind = scaling.get("rope_type")
    require(kind in ROTARY_SCALINGS, "rotary_scaling",
            f"rope_type must be one of {sorted(ROTARY_SCALINGS)}, got {kind!r}")
    require(isinstance(scaling.get("factor"), (int, float)) and scaling["factor"] > 0, "rotary_scaling",
            f"{kind} needs a positive 'factor', got {scaling.get('factor')!r}")
    missing = [key for key in ROTARY_SCALINGS[kind] if scaling.get(key) is None]
    require(not missing, "rotary_scaling", f"{kind} needs {missing}")
    for key in ("short_factor", "long_factor"):  # longrope: one divisor per rotated frequency
        if kind == "longrope" and rotary_dim is not None:
            require(len(scaling[key]) == rotary_dim // 2, "rotary_scaling",
                    f"longrope's {key} needs rotary_dim / 2 = {rotary_dim // 2} values, got {len(scaling[key])}")
