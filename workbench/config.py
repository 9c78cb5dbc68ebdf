"""``ModelConfig``: the one description of a decoder-only transformer.

Every architecture the loaders understand (GPT-2, Llama, Mistral, Qwen2, Mixtral, GGUF llama)
is expressed as values of these fields; components read the config and never branch on an
architecture name. Defaults that depend on other fields (``d_head``, ``n_key_value_heads``,
``d_mlp``, ``rotary_dim``) are resolved once in ``__post_init__``, so after construction every
field holds a concrete value; purely derived quantities are properties.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from workbench.errors import ConfigError

Normalization = Literal["LN", "RMS"]
NormPlacement = Literal["pre", "post"]
Positional = Literal["rotary", "learned", "sinusoidal", "alibi"]
ActFn = Literal["gelu", "gelu_new", "silu", "relu"]
AttnImpl = Literal["eager", "sdpa", "flash"]
# TransformerLens's weight processing, in the order it is applied (``Decoder.process_weights_``).
WEIGHT_PROCESSING_STEPS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")

_CHOICES: dict[str, tuple[str, ...]] = {
    "normalization": ("LN", "RMS"),
    "norm_placement": ("pre", "post"),
    "positional": ("rotary", "learned", "sinusoidal", "alibi"),
    "act_fn": ("gelu", "gelu_new", "silu", "relu"),
    "attn_impl": ("eager", "sdpa", "flash"),
}


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
    act_fn: ActFn = "gelu"
    gated_mlp: bool = False
    attn_only: bool = False
    num_experts: int = 0  # 0: a dense MLP; otherwise a top-k mixture of experts
    experts_per_token: int = 0
    router_renormalize: bool = True  # rescale the top-k router weights to sum to one (Mixtral)
    sliding_window: Optional[int] = None  # a query sees the last `sliding_window` keys, itself included
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
        _require(not (self.use_split_qkv_input and self.norm_placement == "post"), "use_split_qkv_input",
                 "needs a pre-norm model: a post-norm block feeds attention the residual stream itself, "
                 "with no per-head norm to split its input into")
        unknown = sorted(set(self.weight_processing) - set(WEIGHT_PROCESSING_STEPS))
        _require(not unknown, "weight_processing", f"has unknown step(s) {unknown}; known: {WEIGHT_PROCESSING_STEPS}")

    def _set(self, name: str, value: Any) -> None:
        # Frozen dataclass: resolving a default in __post_init__ is the one place we write.
        object.__setattr__(self, name, value)

    # ---- derived values -------------------------------------------------------------------
    @property
    def n_query_groups(self) -> int:
        """Query heads that share one key/value head (1 for MHA, n_heads for MQA)."""
        return self.n_heads // self.n_key_value_heads

    @property
    def attn_scale(self) -> float:
        """Softmax scale applied to q.k."""
        return 1.0 / math.sqrt(self.d_head)

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
        if isinstance(data.get("weight_processing"), list):  # JSON has no tuples
            data["weight_processing"] = tuple(data["weight_processing"])
        return cls(**data)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"ModelConfig.{field} {message}")
