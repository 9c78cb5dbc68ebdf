"""``ModelConfig``: the one description of a decoder-only transformer.

Every architecture the loaders understand (see ``wb.supported_architectures()``) is expressed as
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
from typing import Any, Literal, Optional

import torch

from workbench.errors import ConfigError

Normalization = Literal["LN", "RMS"]
# pre: x + f(norm(x)); post: norm(x + f(x)) (the original transformer); sandwich: x + norm'(f(norm(x)))
# (Gemma 2/3); sublayer_output: x + norm'(f(x)) (OLMo 2). norm' is ln1_post / ln2_post.
NormPlacement = Literal["pre", "post", "sandwich", "sublayer_output"]
Positional = Literal["rotary", "learned", "sinusoidal", "alibi", "none"]
QKNorm = Literal["head", "projection"]
ActFn = Literal["gelu", "gelu_new", "silu", "relu"]
AttnImpl = Literal["eager", "sdpa", "flash"]
# TransformerLens's weight processing, in the order it is applied (``Decoder.process_weights_``).
WEIGHT_PROCESSING_STEPS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")

_CHOICES: dict[str, tuple[str, ...]] = {
    "normalization": ("LN", "RMS"),
    "norm_placement": ("pre", "post", "sandwich", "sublayer_output"),
    "positional": ("rotary", "learned", "sinusoidal", "alibi", "none"),
    "act_fn": ("gelu", "gelu_new", "silu", "relu"),
    "attn_impl": ("eager", "sdpa", "flash"),
}
# RoPE scalings (transformers' rope_type values) and the keys each one needs besides "factor".
ROTARY_SCALINGS: dict[str, tuple[str, ...]] = {
    "linear": (),
    "dynamic": (),
    "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}
# Fields a layer may set differently from the model (``layer_overrides``).
PER_LAYER_FIELDS = ("sliding_window", "positional", "rotary_base", "rotary_scaling", "rotary_dim")


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
    num_experts: int = 0  # 0: a dense MLP; otherwise a top-k mixture of experts
    experts_per_token: int = 0
    router_renormalize: bool = True  # rescale the top-k router weights to sum to one (Mixtral)
    sliding_window: Optional[int] = None  # a query sees the last `sliding_window` keys, itself included
    # TransformerLens's convention: scores are q.k / attn_scale; None: sqrt(d_head) (GPT-Neo: 1.0).
    attn_scale: Optional[float] = None
    attn_scores_soft_cap: Optional[float] = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
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
    # TransformerLens's switches: always compute attn.hook_result (per-head outputs); give each head its own
    # copy of the attention input (hook_q_input / hook_k_input / hook_v_input [batch, pos, heads, d_model]).
    use_attn_result: bool = False
    use_split_qkv_input: bool = False
    # TransformerLens's: tokenizing text puts BOS first (when the tokenizer has one) unless told otherwise.
    default_prepend_bos: bool = True
    # What ``Decoder.process_weights_`` has done to the weights, in order ("fold_ln", ...); () = as loaded.
    weight_processing: tuple[str, ...] = ()
    attn_bias: bool = False
    mlp_bias: bool = False
    attn_impl: AttnImpl = "sdpa"
    # Where the weights live. Kept current by ``Decoder.to``; TransformerLens utilities read them.
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    model_name: str = "custom"
    # One mapping per layer of the PER_LAYER_FIELDS that layer sets differently; () = all alike.
    layer_overrides: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "d_vocab", "n_ctx"):
            _require(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name,
                     f"must be a positive integer, got {getattr(self, name)!r}")
        for name, choices in _CHOICES.items():
            _require(getattr(self, name) in choices, name,
                     f"must be one of {choices}, got {getattr(self, name)!r}")

        if self.d_head is None:
            _require(self.d_model % self.n_heads == 0, "d_head",
                     f"not given, and d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
            self._set("d_head", self.d_model // self.n_heads)
        _require(self.d_head > 0, "d_head", f"must be positive, got {self.d_head}")
        if self.n_key_value_heads is None:
            self._set("n_key_value_heads", self.n_heads)
        _require(0 < self.n_key_value_heads <= self.n_heads and self.n_heads % self.n_key_value_heads == 0,
                 "n_key_value_heads",
                 f"must divide n_heads={self.n_heads}, got {self.n_key_value_heads}")
        if self.d_mlp is None:
            self._set("d_mlp", 4 * self.d_model)
        _require(self.attn_only or self.d_mlp > 0, "d_mlp", f"must be positive, got {self.d_mlp}")
        if self.rotary_dim is None:
            self._set("rotary_dim", self.d_head)
        if self.attn_scale is None:
            self._set("attn_scale", math.sqrt(self.d_head))
        _require(self.attn_scale > 0, "attn_scale", f"must be positive, got {self.attn_scale}")
        for name in ("attn_scores_soft_cap", "output_logits_soft_cap", "clip_qkv"):
            value = getattr(self, name)
            _require(value is None or value > 0, name, f"must be positive or None, got {value!r}")
        _require(self.qk_norm in (None, "head", "projection"), "qk_norm",
                 f"must be None, 'head' or 'projection', got {self.qk_norm!r}")
        _require(self.embed_scale > 0, "embed_scale", f"must be positive, got {self.embed_scale}")
        _check_rotary_scaling(self.rotary_scaling)
        _require(not (self.parallel_attn_mlp and self.norm_placement != "pre"), "parallel_attn_mlp",
                 f"needs norm_placement='pre', got {self.norm_placement!r}")
        _require(not (self.parallel_attn_mlp and self.attn_only), "parallel_attn_mlp",
                 "an attention-only model has no MLP to run in parallel")
        _require(0 < self.rotary_dim <= self.d_head and self.rotary_dim % 2 == 0, "rotary_dim",
                 f"must be even and at most d_head={self.d_head}, got {self.rotary_dim}")
        _require(self.rotary_base > 0, "rotary_base", f"must be positive, got {self.rotary_base}")
        _require(self.norm_eps > 0, "norm_eps", f"must be positive, got {self.norm_eps}")
        _require(self.num_experts >= 0, "num_experts", f"must be >= 0, got {self.num_experts}")
        if self.num_experts:
            _require(0 < self.experts_per_token <= self.num_experts, "experts_per_token",
                     f"must be in 1..num_experts={self.num_experts}, got {self.experts_per_token}")
            _require(not self.attn_only, "num_experts", "an attention-only model has no MLP to make a mixture of")
        else:
            _require(self.experts_per_token == 0, "experts_per_token",
                     f"is {self.experts_per_token} but num_experts is 0 (no mixture of experts)")
        if self.sliding_window is not None:
            _require(isinstance(self.sliding_window, int) and self.sliding_window > 0, "sliding_window",
                     f"must be a positive integer or None, got {self.sliding_window!r}")
        _require(isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point, "dtype",
                 f"must be a floating-point torch.dtype, got {self.dtype!r}")
        _require(not (self.use_split_qkv_input and self.norm_placement != "pre"), "use_split_qkv_input",
                 f"needs norm_placement='pre' (a norm in front of attention to give each head its own "
                 f"copy of), got {self.norm_placement!r}")
        unknown = sorted(set(self.weight_processing) - set(WEIGHT_PROCESSING_STEPS))
        _require(not unknown, "weight_processing", f"has unknown step(s) {unknown}; known: {WEIGHT_PROCESSING_STEPS}")
        self._check_layer_overrides()

    def _check_layer_overrides(self) -> None:
        overrides = self.layer_overrides
        if isinstance(overrides, list):  # from JSON
            overrides = tuple(overrides)
            self._set("layer_overrides", overrides)
        if not overrides:
            return
        _require(len(overrides) == self.n_layers, "layer_overrides",
                 f"must have one mapping per layer ({self.n_layers}), got {len(overrides)}")
        for layer, override in enumerate(overrides):
            unknown = sorted(set(override) - set(PER_LAYER_FIELDS))
            _require(not unknown, "layer_overrides",
                     f"layer {layer} sets {unknown}; a layer may set only {PER_LAYER_FIELDS}")
            if "positional" in override:
                _require({override["positional"], self.positional} <= {"rotary", "none"}, "layer_overrides",
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
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def normalization_type(self) -> str:
        """TransformerLens's name for ``normalization`` (read by ``ActivationCache`` helpers)."""
        return self.normalization

    # ---- (de)serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``from_dict(cfg.to_dict()) == cfg``."""
        out = dataclasses.asdict(self)
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """Inverse of ``to_dict``; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"ModelConfig: unknown field(s) {unknown}")
        data = dict(data)
        if isinstance(data.get("dtype"), str):
            data["dtype"] = getattr(torch, data["dtype"])
        for name in ("weight_processing", "layer_overrides"):  # JSON has no tuples
            if isinstance(data.get(name), list):
                data[name] = tuple(data[name])
        return cls(**data)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _check_rotary_scaling(scaling: Optional[dict[str, Any]]) -> None:
    if scaling is None:
        return
    _require(isinstance(scaling, dict), "rotary_scaling", f"must be a mapping or None, got {scaling!r}")
    kind = scaling.get("rope_type")
    _require(kind in ROTARY_SCALINGS, "rotary_scaling",
             f"rope_type must be one of {sorted(ROTARY_SCALINGS)}, got {kind!r}")
    _require(isinstance(scaling.get("factor"), (int, float)) and scaling["factor"] > 0, "rotary_scaling",
             f"{kind} needs a positive 'factor', got {scaling.get('factor')!r}")
    missing = [key for key in ROTARY_SCALINGS[kind] if scaling.get(key) is None]
    _require(not missing, "rotary_scaling", f"{kind} needs {missing}")


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"ModelConfig.{field} {message}")
