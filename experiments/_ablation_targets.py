"""Ablation targets and the hooks that ablate them (re-exported by ``experiments.ablation``).

Legend: B batch, P position, H heads, K d_head, D d_model, M d_mlp, k experts per token.
See ``experiments.ablation`` for where each kind is ablated and what each method writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

import torch
from torch import Tensor

from experiments._tokens import TokensLike, as_batch
from workbench.errors import InputError

Kind = Literal["head", "attn_layer", "mlp_layer", "neuron", "expert"]
Method = Literal["zero", "mean", "resample"]
KINDS: tuple[str, ...] = ("head", "attn_layer", "mlp_layer", "neuron", "expert")
METHODS: tuple[str, ...] = ("zero", "mean", "resample")
Hook = tuple[str, Callable]


@dataclass(frozen=True)
class AblationTarget:
    """One thing to ablate: ``kind`` at ``layer``, with ``index`` the head, neuron or expert.

    Example:
        >>> AblationTarget("head", 3, 4).hook_name
        'blocks.3.attn.hook_z'
    """

    kind: Kind
    layer: int
    index: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"AblationTarget.kind must be one of {KINDS}, got {self.kind!r}")
        needs_index = self.kind in ("head", "neuron", "expert")
        if needs_index and self.index is None:
            raise InputError(f"AblationTarget of kind {self.kind!r} needs an index (which {self.kind})")
        if not needs_index and self.index is not None:
            raise InputError(f"AblationTarget of kind {self.kind!r} ablates the whole layer; index must be None")

    @property
    def hook_name(self) -> str:
        l = self.layer
        return {"head": f"blocks.{l}.attn.hook_z", "attn_layer": f"blocks.{l}.hook_attn_out",
                "mlp_layer": f"blocks.{l}.hook_mlp_out", "neuron": f"blocks.{l}.mlp.hook_post",
                "expert": f"blocks.{l}.mlp.hook_expert_weights"}[self.kind]

    def check(self, cfg) -> None:
        """Raises InputError when this target does not exist in a model with config ``cfg``."""
        if not 0 <= self.layer < cfg.n_layers:
            raise InputError(f"{self}: layer must be in 0..{cfg.n_layers - 1}")
        if self.kind in ("mlp_layer", "neuron", "expert") and cfg.attn_only:
            raise InputError(f"{self}: this model is attention-only and has no MLP")
        if self.kind == "neuron" and cfg.is_moe:
            raise InputError(f"{self}: a mixture-of-experts layer has no single neuron axis; ablate an expert")
        if self.kind == "expert" and not cfg.is_moe:
            raise InputError(f"{self}: this model has no mixture of experts (num_experts=0)")
        size = {"head": cfg.n_heads, "neuron": cfg.d_mlp, "expert": cfg.num_experts}.get(self.kind)
        if size is not None and not 0 <= self.index < size:
            raise InputError(f"{self}: index must be in 0..{size - 1}")


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise InputError(f"ablation method must be one of {METHODS}, got {method!r}")


def _replace(activation: Tensor, target: AblationTarget, value: Optional[Tensor]) -> Tensor:
    """``activation`` (a clone) with the target's slice set to ``value`` (zero when None).

    ``value`` may run past the activation's positions (a batched sweep can leave out the last
    one); its leading positions are used.
    """
    if value is not None:
        value = value[:, :activation.shape[1]]
    if target.kind in ("head", "neuron"):
        activation[:, :, target.index] = 0 if value is None else value[:, :, target.index]
    else:
        activation[:] = 0 if value is None else value
    return activation


def _reference_values(model, hook_names: set[str], method: str, reference_BP: Tensor,
                      resample_shift: int) -> dict[str, Callable[[int, int], Tensor]]:
    """For each hook: a function (batch, pos) -> replacement activation of that shape."""
    _, cache = model.run_with_cache(reference_BP, names_filter=lambda name: name in hook_names)
    n_ref, p_ref = reference_BP.shape

    def getter(act: Tensor) -> Callable[[int, int], Tensor]:
        mean = act.mean(0, keepdim=True) if method == "mean" else None

        def value(batch: int, pos: int) -> Tensor:
            if pos > p_ref:
                raise InputError(f"{method} ablation: the reference has {p_ref} positions, fewer than the input's {pos}")
            if method == "mean":
                return mean[:, :pos]
            if resample_shift and n_ref < 2:
                raise InputError("resample ablation needs another prompt: pass reference_tokens or a batch of 2+")
            rows = (torch.arange(batch) + resample_shift) % n_ref
            return act[rows.to(act.device), :pos]

        return value

    return {name: getter(cache[name]) for name in hook_names}


def _expert_hooks(layer: int, experts: set[int]) -> list[Hook]:
    """Zeroes the router weight of ``experts`` wherever they were chosen in ``layer``.

    ``hook_expert_weights`` runs before ``hook_expert_indices`` and both are used only after
    the second, so the weights are kept from the first hook and masked once the indices are known.
    """
    kept: dict[str, Tensor] = {}
    expert_ids = torch.tensor(sorted(experts))

    def keep_weights(weights_BPk: Tensor, hook) -> Tensor:
        kept["weights"] = weights_BPk.clone()
        return kept["weights"]

    def drop_experts(indices_BPk: Tensor, hook) -> Tensor:
        kept.pop("weights").masked_fill_(torch.isin(indices_BPk, expert_ids.to(indices_BPk.device)), 0)
        return indices_BPk

    return [(f"blocks.{layer}.mlp.hook_expert_weights", keep_weights),
            (f"blocks.{layer}.mlp.hook_expert_indices", drop_experts)]


@torch.no_grad()
def ablation_hooks(model, targets: Sequence[AblationTarget], method: Method = "zero",
                   reference_tokens: Optional[TokensLike] = None, *, resample_shift: int = 0) -> list[Hook]:
    """Forward hooks (name, fn) that ablate ``targets``; pass them to ``model.run_with_hooks``.

    "mean" and "resample" need ``reference_tokens`` ([n_ref, p_ref] with p_ref >= the input's
    positions); "resample" gives input row b the activation of reference row (b + resample_shift) % n_ref.

    Example:
        >>> hooks = ablation_hooks(model, [AblationTarget("head", 1, 0)], "mean", reference_tokens=ref)   # doctest: +SKIP
        >>> model.run_with_hooks(tokens, return_type="loss", fwd_hooks=hooks)                              # doctest: +SKIP
    """
    _check_method(method)
    targets = list(targets)
    if not targets:
        raise InputError("no ablation targets given")
    for target in targets:
        target.check(model.cfg)
    hooks: list[Hook] = []
    experts: dict[int, set[int]] = {}
    for target in (t for t in targets if t.kind == "expert"):
        if method != "zero":
            raise InputError(f"{target}: experts support zero ablation only, got method {method!r}")
        experts.setdefault(target.layer, set()).add(target.index)
    for layer, ids in experts.items():
        hooks += _expert_hooks(layer, ids)
    others = [t for t in targets if t.kind != "expert"]
    if method == "zero":
        values = {}
    else:
        if reference_tokens is None:
            raise InputError(f"{method} ablation needs reference_tokens (the prompts whose activations replace the input's)")
        values = _reference_values(model, {t.hook_name for t in others}, method,
                                   as_batch(model, reference_tokens), resample_shift)
    for target in others:
        value_of = values.get(target.hook_name)

        def ablate(activation: Tensor, hook, target=target, value_of=value_of) -> Tensor:
            value = None if value_of is None else value_of(activation.shape[0], activation.shape[1])
            return _replace(activation.clone(), target, value)

        hooks.append((target.hook_name, ablate))
    return hooks
