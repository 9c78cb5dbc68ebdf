"""What a ``ModelConfig`` may hold: the allowed values of its choice fields, the RoPE scalings and the fields a
layer may override, and ``check_model_config``, the checks a config passes once its defaults are resolved
(each failure a ``ConfigError`` naming the field). ``workbench.config`` re-exports the names users import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Optional, get_args

from workbench.sub_configs import LatentAttentionConfig, MoEConfig, require

if TYPE_CHECKING:
    from workbench.config import ModelConfig

Normalization = Literal["LN", "RMS"]
# pre: x + f(norm(x)); post: norm(x + f(x)) (the original transformer); sandwich: x + norm'(f(norm(x)))
# (Gemma 2/3); sublayer_output: x + norm'(f(x)) (OLMo 2). norm' is ln1_post / ln2_post.
NormPlacement = Literal["pre", "post", "sandwich", "sublayer_output"]
Positional = Literal["rotary", "learned", "sinusoidal", "alibi", "none"]
QKNorm = Literal["head", "projection"]
# relu2: relu(x)^2 (Nemotron, Arcee); xielu: Apertus's, with learned scalars per layer (dense MLPs only)
ActFn = Literal["gelu", "gelu_new", "silu", "relu", "relu2", "xielu"]
# The sinusoidal position table's layout (see ModelConfig.sinusoidal_style).
SinusoidalStyle = Literal["interleaved", "fairseq"]
# The allowed values of each choice field: read off its Literal, so they are written down once.
CHOICES: dict[str, tuple[str, ...]] = {
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
                    # Llama 4: chunked attention, the QK norm and the query scaling on some layers only
                    "attention_chunk_size", "qk_norm", "query_scale_beta", "query_scale_length",
                    "differential_lambda_init")


def check_sizes_and_choices(cfg: "ModelConfig") -> None:
    """The checks that come before any default is resolved: the sizes are positive integers and every choice
    field holds one of its values.

    Example:
        >>> from workbench.config import ModelConfig
        >>> ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, act_fn="tanh")
        Traceback (most recent call last):
        ...
        workbench.errors.ConfigError: ModelConfig.act_fn must be one of ('gelu', ...), got 'tanh'
    """
    for name in ("n_layers", "d_model", "n_heads", "d_vocab", "n_ctx"):
        require(isinstance(getattr(cfg, name), int) and getattr(cfg, name) > 0, name,
                f"must be a positive integer, got {getattr(cfg, name)!r}")
    for name, choices in CHOICES.items():
        require(getattr(cfg, name) in choices, name, f"must be one of {choices}, got {getattr(cfg, name)!r}")


def check_model_config(cfg: "ModelConfig") -> None:
    """Every check on a config whose defaults are resolved (``ModelConfig.__post_init__`` runs it).

    Example:
        >>> from workbench.config import ModelConfig
        >>> ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, norm_placement="post",
        ...             parallel_attn_mlp=True)
        Traceback (most recent call last):
        ...
        workbench.errors.ConfigError: ModelConfig.parallel_attn_mlp needs norm_placement='pre', got 'post'
    """
    require(cfg.attn_scale > 0, "attn_scale", f"must be positive, got {cfg.attn_scale}")
    for name in ("attn_scores_soft_cap", "output_logits_soft_cap", "clip_qkv"):
        value = getattr(cfg, name)
        require(value is None or value > 0, name, f"must be positive or None, got {value!r}")
    require(cfg.qk_norm in (None, "head", "projection"), "qk_norm",
            f"must be None, 'head' or 'projection', got {cfg.qk_norm!r}")
    require(cfg.embed_scale > 0, "embed_scale", f"must be positive, got {cfg.embed_scale}")
    _check_scalings_and_attention_variants(cfg)
    _check_rotary_scaling(cfg.rotary_scaling, cfg.rotary_dim)
    require(not (cfg.parallel_attn_mlp and cfg.norm_placement != "pre"), "parallel_attn_mlp",
            f"needs norm_placement='pre', got {cfg.norm_placement!r}")
    require(not (cfg.parallel_attn_mlp and cfg.attn_only), "parallel_attn_mlp",
            "an attention-only model has no MLP to run in parallel")
    require(0 < cfg.rotary_dim <= cfg.d_head and cfg.rotary_dim % 2 == 0, "rotary_dim",
            f"must be even and at most d_head={cfg.d_head}, got {cfg.rotary_dim}")
    require(cfg.rotary_base > 0, "rotary_base", f"must be positive, got {cfg.rotary_base}")
    require(cfg.norm_eps > 0, "norm_eps", f"must be positive, got {cfg.norm_eps}")
    require(cfg.num_experts >= 0, "num_experts", f"must be >= 0, got {cfg.num_experts}")
    if cfg.num_experts:
        require(0 < cfg.experts_per_token <= cfg.num_experts, "experts_per_token",
                f"must be in 1..num_experts={cfg.num_experts}, got {cfg.experts_per_token}")
        require(not cfg.attn_only, "num_experts", "an attention-only model has no MLP to make a mixture of")
    else:
        require(cfg.experts_per_token == 0, "experts_per_token",
                f"is {cfg.experts_per_token} but num_experts is 0 (no mixture of experts)")
    _check_router(cfg)
    _check_latent_attention(cfg)
    if cfg.sliding_window is not None:
        require(isinstance(cfg.sliding_window, int) and cfg.sliding_window > 0, "sliding_window",
                f"must be a positive integer or None, got {cfg.sliding_window!r}")
    _check_layer_overrides(cfg)


def _check_scalings_and_attention_variants(cfg: "ModelConfig") -> None:
    """A positive logits scale; xIELU in dense ungated MLPs only; a query scaling needs both its beta and its
    length; differential attention pairs its heads; a positive chunk size."""
    require(cfg.logits_scale > 0, "logits_scale", f"must be positive, got {cfg.logits_scale!r}")
    require(cfg.act_fn != "xielu" or not (cfg.gated_mlp or cfg.num_experts), "act_fn",
            "'xielu' is supported in dense MLPs without a gate only")
    beta, length = cfg.query_scale_beta, cfg.query_scale_length
    require((beta is None) == (length is None), "query_scale_beta",
            f"and query_scale_length must be set together, got {beta!r} and {length!r}")
    require(length is None or (isinstance(length, int) and length > 0), "query_scale_length",
            f"must be a positive integer or None, got {length!r}")
    require(cfg.differential_lambda_init is None or (cfg.n_key_value_heads % 2 == 0 and cfg.n_heads % 2 == 0
            and cfg.latent is None), "differential_lambda_init",
            "needs an even number of query and key/value heads (they pair up) and standard attention")
    chunk = cfg.attention_chunk_size
    require(chunk is None or (isinstance(chunk, int) and chunk > 0), "attention_chunk_size",
            f"must be a positive integer or None, got {chunk!r}")


def _check_router(cfg: "ModelConfig") -> None:
    """What the mixture's settings (each checked by ``MoEConfig``) must agree on with the expert count."""
    require(isinstance(cfg.moe, MoEConfig), "moe", f"must be a MoEConfig, got {cfg.moe!r}")
    require(cfg.moe.router_scoring != "sparsemixer" or not cfg.num_experts or cfg.experts_per_token == 2,
            "experts_per_token", f"must be 2 with sparsemixer routing, got {cfg.experts_per_token}")
    groups, topk_groups = cfg.moe.router_groups, cfg.moe.router_topk_groups
    if groups is None or not cfg.num_experts:
        return
    per_group = cfg.num_experts // groups
    require(cfg.num_experts % groups == 0, "moe.router_groups",
            f"must divide num_experts={cfg.num_experts}, got {groups}")
    require(cfg.moe.router_group_score != "top2_sum" or per_group >= 2, "moe.router_group_score",
            f"'top2_sum' needs at least two experts per group, got {per_group}")
    require(cfg.experts_per_token <= topk_groups * per_group, "experts_per_token",
            f"is {cfg.experts_per_token} but the {topk_groups} chosen group(s) hold only "
            f"{topk_groups * per_group} experts")


def _check_latent_attention(cfg: "ModelConfig") -> None:
    """Latent attention rotates, expands keys and values for every head, and has no QK norm or clipping."""
    if cfg.latent is None:
        return
    require(isinstance(cfg.latent, LatentAttentionConfig), "latent",
            f"must be a LatentAttentionConfig or None, got {cfg.latent!r}")
    require(cfg.positional == "rotary", "latent", f"latent attention needs positional='rotary', got {cfg.positional!r}")
    require(cfg.n_key_value_heads == cfg.n_heads, "n_key_value_heads",
            f"latent attention expands keys and values for every head: must equal n_heads={cfg.n_heads}, "
            f"got {cfg.n_key_value_heads}")
    for name in ("qk_norm", "clip_qkv"):
        require(getattr(cfg, name) is None, name, "is not supported with latent attention (latent)")


def _check_layer_overrides(cfg: "ModelConfig") -> None:
    """One mapping per layer, each setting only ``PER_LAYER_FIELDS`` to values that are valid in that layer."""
    overrides = cfg.layer_overrides
    if not overrides:
        return
    require(len(overrides) == cfg.n_layers, "layer_overrides",
            f"must have one mapping per layer ({cfg.n_layers}), got {len(overrides)}")
    for layer, override in enumerate(overrides):
        unknown = sorted(set(override) - set(PER_LAYER_FIELDS))
        require(not unknown, "layer_overrides",
                f"layer {layer} sets {unknown}; a layer may set only {PER_LAYER_FIELDS}")
        if "positional" in override:
            require({override["positional"], cfg.positional} <= {"rotary", "none"}, "layer_overrides",
                    f"layer {layer}: a layer may only switch between 'rotary' and 'none' positions "
                    f"(the model's is {cfg.positional!r}, the layer's {override['positional']!r})")
        cfg.for_layer(layer)  # validates the layer's values


def _check_rotary_scaling(scaling: Optional[dict[str, Any]], rotary_dim: Optional[int] = None) -> None:
    """A known ``rope_type`` with a positive factor and that type's own keys (longrope: one divisor per
    rotated frequency)."""
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
