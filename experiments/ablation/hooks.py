"""Forward hooks that ablate targets, and a run under them.

Legend: B batch, P position, k experts_per_token.

``ablation_hooks`` builds one hook per hook point (experts: a pair on the router); ``run_ablated``
runs the model under them. Without a reference the input batch is its own: "mean" uses its mean
(pads excluded) and "resample" gives each row the next row's activations (``hooks_for_input``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from workbench.tokens_api import TextOrTokens
from experiments.ablation.references import reference_values, token_positions
from experiments.ablation.targets import AblationTarget, Method, check_method
from experiments.metrics import PromptBatch, prompt_batch
from workbench.errors import InputError

Hook = tuple[str, Callable]


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
                   reference_tokens: Optional[TextOrTokens] = None, *, resample_shift: int = 0,
                   reference_mask: Optional[Tensor] = None, reference_means: Optional[dict] = None,
                   attention_mask: Optional[Tensor] = None, padding_side: str = "right") -> list[Hook]:
    """Forward hooks (name, fn) that ablate ``targets``; pass them to ``model.run_with_hooks``.

    "mean" needs ``reference_tokens`` (the mean over them at each position, pads excluded) or a
    precomputed ``reference_means`` ({hook name: [1, P, ...]}, e.g. from ``mean_reference`` over a
    corpus); "resample" needs ``reference_tokens`` and gives input row b the activation of reference
    row (b + resample_shift) % n_ref. A padded reference takes ``reference_mask`` (a list of texts
    pads on ``padding_side`` and builds it). The reference must have at least the input's positions.

    ``attention_mask`` is the mask of the input the hooks will run on: with it each padded row reads
    the reference at its own positions (its p-th real token takes position p); without it column p
    is position p (right padding or none).

    Example:
        >>> reference = model.to_tokens("A dog ran in the park. The dog ran")          # as long as ``tokens``
        >>> hooks = ablation_hooks(model, [AblationTarget("head", 1, 0)], "mean", reference_tokens=reference)
        >>> [name for name, _ in hooks]
        ['blocks.1.attn.hook_z']
        >>> ablated = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=hooks)
        >>> bool(ablated != model(tokens, return_type="loss"))
        True
    """
    check_method(method)
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
        if reference_means is not None and (method != "mean" or reference_tokens is not None):
            raise InputError("reference_means is a precomputed mean: it serves method='mean' in place of "
                             "reference_tokens; give one of them" if method == "mean" else
                             f"reference_means serves mean ablation only; {method} ablation needs reference_tokens")
        if reference_tokens is None and reference_means is None:
            raise InputError(f"{method} ablation needs reference_tokens (the prompts whose activations replace the "
                             f"input's)" + (" or reference_means" if method == "mean" else ""))
        values = reference_values(model, {t.hook_name for t in others}, method, reference_tokens, resample_shift,
                                  reference_mask=reference_mask, reference_means=reference_means,
                                  padding_side=padding_side)
    positions_BP = None if attention_mask is None else token_positions(_as_mask(attention_mask))
    for target in others:
        value_of = values.get(target.hook_name)

        def ablate(activation: Tensor, hook, site=target.site, value_of=value_of) -> Tensor:
            value = None if value_of is None else value_of(*activation.shape[:2], _positions_for(positions_BP, activation))
            return site.write(activation.clone(), value)

        hooks.append((target.hook_name, ablate))
    return hooks


def _as_mask(attention_mask: Tensor) -> Tensor:
    mask = torch.as_tensor(attention_mask)
    mask = mask[None] if mask.ndim == 1 else mask
    if mask.ndim != 2:
        raise InputError(f"attention_mask must be [batch, pos] (1 real, 0 pad), got shape {tuple(mask.shape)}")
    return mask.bool()


def _positions_for(positions_BP: Optional[Tensor], activation: Tensor) -> Optional[Tensor]:
    """The input's own positions for an activation [B, P', ...] (P' <= P: a run may leave out the last positions)."""
    if positions_BP is None:
        return None
    B, P = activation.shape[:2]
    if positions_BP.shape[0] != B or positions_BP.shape[1] < P:
        raise InputError(f"the ablation hooks were built for an attention_mask of shape {tuple(positions_BP.shape)} "
                         f"but ran on an activation of {B} rows and {P} positions; pass the input's own mask")
    return positions_BP[:, :P]


def hooks_for_input(model, batch: PromptBatch, targets, method: str, reference_tokens,
                    reference_mask: Optional[Tensor] = None, reference_means: Optional[dict] = None,
                    padding_side: str = "right") -> list[Hook]:
    """Hooks for ``batch``, where a missing reference means the batch itself (resample: its next row).

    Example:
        >>> batch = prompt_batch(model, ["The cat sat", "The dog ran"])
        >>> [name for name, _ in hooks_for_input(model, batch, [AblationTarget("head", 0, 1)], "resample", None)]
        ['blocks.0.attn.hook_z']
    """
    if reference_tokens is None and reference_means is None and method != "zero":
        return ablation_hooks(model, targets, method, batch.tokens, resample_shift=1 if method == "resample" else 0,
                              reference_mask=batch.mask, attention_mask=batch.mask)
    return ablation_hooks(model, targets, method, reference_tokens, reference_mask=reference_mask,
                          reference_means=reference_means, attention_mask=batch.mask, padding_side=padding_side)


def run_ablated(model, tokens: TextOrTokens, targets: Sequence[AblationTarget], method: Method = "zero",
                reference_tokens: Optional[TextOrTokens] = None, return_type: Optional[str] = "logits", *,
                attention_mask: Optional[Tensor] = None, padding_side: str = "right",
                reference_mask: Optional[Tensor] = None, reference_means: Optional[dict] = None):
    """Runs the model with ``targets`` ablated; returns what ``model(..., return_type=)`` returns.

    Without a reference, "mean" uses the input batch's own mean (pads excluded) and "resample"
    gives each row the activations of the next row. A padded batch takes ``attention_mask`` (a list
    of texts builds it, padded on ``padding_side``); the mask reaches the ablated run and, when the
    input is its own reference, the reference run. ``reference_mask`` / ``reference_means`` as in
    ``ablation_hooks``.

    Example:
        >>> clean = model(tokens, return_type="loss")
        >>> bool(run_ablated(model, tokens, [AblationTarget("attn_layer", 0)], return_type="loss") > clean)
        True
        >>> run_ablated(model, ["The cat sat", "The"], [AblationTarget("head", 0, 1)], "mean").shape   # padded, masked
        torch.Size([2, 6, 2048])
    """
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    hooks = hooks_for_input(model, batch, targets, method, reference_tokens, reference_mask, reference_means,
                            padding_side)
    return model.run_with_hooks(batch.tokens, attention_mask=batch.mask, return_type=return_type, fwd_hooks=hooks)


