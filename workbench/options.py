"""``RuntimeOptions``: how a built model runs and where its weights live, apart from what it is.

``ModelConfig`` describes an architecture and never changes after a model is built. These options do: the
storage dtype and device (kept current by ``Decoder.to``), the attention kernel (``set_attn_impl``),
TransformerLens's switches (``set_use_attn_result``, ``set_use_split_qkv_input``, ``set_use_hook_mlp_in``,
``set_ungroup_grouped_query_attention``) and the record of
what weight processing has done. A ``Decoder`` owns one ``RuntimeOptions`` and every component that reads
an option holds that same object, so a switch is one validated assignment and no copy goes stale.

``ConfigView`` is ``model.cfg``: TransformerLens's utilities read architecture and runtime values from one
config object (``model.cfg.n_layers``, ``model.cfg.device``, ``model.cfg.use_attn_result``), so the view
answers both, read-only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from workbench.config import ModelConfig
from workbench.errors import ConfigError

AttnImpl = Literal["eager", "sdpa", "flash"]
ATTN_IMPLS: tuple[str, ...] = get_args(AttnImpl)
# TransformerLens's weight processing, in the order it is applied (``Decoder.process_weights_``).
WEIGHT_PROCESSING_STEPS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases",
                           "refactor_factored_attn_matrices")


def _dtype(value: Any) -> torch.dtype:
    value = getattr(torch, value) if isinstance(value, str) and hasattr(torch, value) else value
    if not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ConfigError(f"dtype must be a floating-point torch.dtype or its name (float32, bfloat16, ...), "
                          f"got {value!r}")
    return value


def _attn_impl(value: Any) -> str:
    if value not in ATTN_IMPLS:
        raise ConfigError(f"attn_impl must be one of {ATTN_IMPLS}, got {value!r}")
    return value


def _switch(name: str) -> Any:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}")
        return value
    return check


def _steps(value: Any) -> tuple[str, ...]:
    steps = tuple(value)
    unknown = sorted(set(steps) - set(WEIGHT_PROCESSING_STEPS))
    if unknown:
        raise ConfigError(f"weight_processing has unknown step(s) {unknown}; known: {WEIGHT_PROCESSING_STEPS}")
    return steps


# Each option's check, which also normalises (a dtype's name to the dtype, a list of steps to a tuple).
_CHECKS = {"dtype": _dtype, "device": str, "attn_impl": _attn_impl, "use_attn_result": _switch("use_attn_result"),
           "use_split_qkv_input": _switch("use_split_qkv_input"), "use_hook_mlp_in": _switch("use_hook_mlp_in"),
           "weight_processing": _steps,
           "default_prepend_bos": _switch("default_prepend_bos"),
           "ungroup_grouped_query_attention": _switch("ungroup_grouped_query_attention")}
# Written into a saved model's config.json beside the architecture (the device is where it is loaded).
SAVED_OPTIONS = ("dtype", "attn_impl", "use_attn_result", "use_split_qkv_input", "use_hook_mlp_in", "weight_processing",
                 "default_prepend_bos", "ungroup_grouped_query_attention")


@dataclass(eq=True)
class RuntimeOptions:
    """The options a model runs under; every assignment is checked.

    Example:
        >>> options = RuntimeOptions(attn_impl="eager")
        >>> options.attn_impl = "flash"; options.attn_impl
        'flash'
        >>> options.attn_impl = "fast"
        Traceback (most recent call last):
        ...
        workbench.errors.ConfigError: attn_impl must be one of ('eager', 'sdpa', 'flash'), got 'fast'
    """

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    attn_impl: AttnImpl = "sdpa"
    # TransformerLens's switches: always compute attn.hook_result (per-head outputs); give each head its own
    # copy of the attention input (hook_q_input / hook_k_input / hook_v_input [batch, pos, heads, d_model]).
    use_attn_result: bool = False
    use_split_qkv_input: bool = False
    # Always compute blocks.{l}.hook_mlp_in, the MLP's own copy of its input (off: only where hooked, same values).
    use_hook_mlp_in: bool = False
    # What ``Decoder.process_weights_`` has done to the weights, in order ("fold_ln", ...); () = as loaded.
    weight_processing: tuple[str, ...] = ()
    # TransformerLens's: tokenizing text puts BOS first (when the tokenizer has one) unless told otherwise.
    default_prepend_bos: bool = True
    # TransformerLens 3's switch: a grouped-query model's hook_k / hook_v (hook_rot_k, hook_k_input / hook_v_input,
    # the KV cache) carry one key/value head per query head, each its group's copy, so per-head loops written for
    # n_heads run and an edit to one head's key or value reaches that query head only. Off: grouped and fast.
    ungroup_grouped_query_attention: bool = False

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _CHECKS:
            raise ConfigError(f"RuntimeOptions has no option {name!r}; options: {tuple(_CHECKS)}")
        object.__setattr__(self, name, _CHECKS[name](value))

    def check_for(self, cfg: ModelConfig) -> None:
        """The options that depend on the architecture: ``use_split_qkv_input`` needs a norm in front of
        attention to give each head its own copy of (pre-norm) and heads with their own keys and values;
        ``use_hook_mlp_in`` needs MLPs (as TransformerLens refuses it on an attention-only model).

        Example:
            >>> cfg = ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, norm_placement="post")
            >>> RuntimeOptions(use_split_qkv_input=True).check_for(cfg)
            Traceback (most recent call last):
            ...
            workbench.errors.ConfigError: use_split_qkv_input needs norm_placement='pre' (a norm in front of attention to give each head its own copy of), got 'post'
        """
        if self.ungroup_grouped_query_attention:
            if cfg.is_latent_attention:
                raise ConfigError("ungroup_grouped_query_attention: latent attention (kv_lora_rank) already expands "
                                  "every head's keys and values (hook_k / hook_v [batch, pos, n_heads, d_head])")
            if cfg.qk_norm == "projection" and cfg.n_key_value_heads != cfg.n_heads:
                raise ConfigError("ungroup_grouped_query_attention: this model's key norm (qk_norm='projection') "
                                  "normalises all key/value heads together, which per-query-head copies would change")
        if self.use_hook_mlp_in and cfg.attn_only:
            raise ConfigError("use_hook_mlp_in needs MLPs: this model is attention-only (attn_only=True), it has no "
                              "blocks.{l}.hook_mlp_in")
        if not self.use_split_qkv_input:
            return
        if cfg.norm_placement != "pre":
            raise ConfigError(f"use_split_qkv_input needs norm_placement='pre' (a norm in front of attention to give "
                              f"each head its own copy of), got {cfg.norm_placement!r}")
        if cfg.is_latent_attention:
            raise ConfigError("use_split_qkv_input is not supported with latent attention (kv_lora_rank): heads "
                              "share the latent")

    def to_saved(self) -> dict[str, Any]:
        """The options a saved model keeps, JSON-ready.

        Example:
            >>> RuntimeOptions(dtype=torch.bfloat16).to_saved()["dtype"]
            'bfloat16'
        """
        out = {name: getattr(self, name) for name in SAVED_OPTIONS}
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        out["weight_processing"] = list(self.weight_processing)
        return out

    def replace(self, **changes: Any) -> "RuntimeOptions":
        """A checked copy with some options changed.

        Example:
            >>> RuntimeOptions().replace(attn_impl="eager").attn_impl
            'eager'
        """
        return dataclasses.replace(self, **changes)


def split_saved_config(data: dict[str, Any]) -> tuple[ModelConfig, dict[str, Any]]:
    """A saved model's config.json (the architecture and, beside it, the options it was saved with) as the
    ``ModelConfig`` and the options. Files written before the two were apart hold ``device`` too: ignored.

    Example:
        >>> cfg, options = split_saved_config({"n_layers": 1, "d_model": 8, "n_heads": 2, "d_vocab": 10,
        ...                                    "n_ctx": 8, "attn_impl": "eager", "device": "cuda:0"})
        >>> cfg.n_layers, options
        (1, {'attn_impl': 'eager'})
    """
    options = {name: data[name] for name in SAVED_OPTIONS if name in data}
    architecture = {name: value for name, value in data.items() if name not in _CHECKS}
    return ModelConfig.from_dict(architecture), options


class ConfigView:
    """``model.cfg``: the architecture and the runtime options read as one config, as TransformerLens reads
    ``model.cfg``. Assigning an option (``model.cfg.default_prepend_bos = False``, as TransformerLens users
    do) sets it on the model's options, checked; the architecture cannot be assigned.

    Example:
        >>> view = ConfigView(ModelConfig(n_layers=2, d_model=8, n_heads=2, d_vocab=10, n_ctx=8), RuntimeOptions())
        >>> view.n_layers, view.attn_impl, view.dtype
        (2, 'sdpa', torch.float32)
    """

    __slots__ = ("config", "options")

    def __init__(self, config: ModelConfig, options: RuntimeOptions):
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "options", options)

    def __getattr__(self, name: str) -> Any:
        if name in _CHECKS:
            return getattr(self.options, name)
        return getattr(self.config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _CHECKS:
            raise AttributeError(f"cfg.{name} is part of the architecture (ModelConfig), fixed once the model is "
                                 f"built: build another model from cfg.config.replace({name}=...)")
        checked = self.options.replace(**{name: value})
        checked.check_for(self.config)
        setattr(self.options, name, getattr(checked, name))

    def __eq__(self, other: object) -> bool:
        """Another view: the same architecture and options. A ``ModelConfig``: the same architecture."""
        if isinstance(other, ConfigView):
            return self.config == other.config and self.options == other.options
        if isinstance(other, ModelConfig):
            return self.config == other
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"ConfigView({self.config!r}, {self.options!r})"

    def to_dict(self) -> dict[str, Any]:
        """The architecture's fields and the options a saved model keeps, JSON-ready (a saved config.json).

        Example:
            >>> ConfigView(ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8),
            ...            RuntimeOptions()).to_dict()["attn_impl"]
            'sdpa'
        """
        return {**self.config.to_dict(), **self.options.to_saved()}

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self.config)) | set(_CHECKS) | {"config", "options", "to_dict"})
