"""The values mean and resample ablation write: a reference's mean at each position, or another prompt's activation.

Legend: B batch, P position.

A reference is read at each prompt's own positions: the p-th real token of an input row takes the
reference's p-th real token, whichever side either batch is padded on. A mean is computed batch by
batch (``experiments.datasets.mean_activations``), so a big corpus never needs one giant cache.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from experiments._progress import ProgressArg
from workbench.tokens_api import TextOrTokens
from experiments.ablation.targets import AblationTarget
from experiments.datasets import mean_activations
from experiments.metrics import PromptBatch, prompt_batch
from workbench.errors import InputError

# The value a hook writes: (rows, positions, each column's position in its own prompt or None) -> [rows or 1, positions, ...]
ValueOf = Callable[..., Tensor]


def token_positions(mask_BP: Optional[Tensor]) -> Optional[Tensor]:
    """Each column's position within its own prompt (its real tokens count from 0; a pad takes its
    neighbour's), or None when nothing is padding (column p is position p).

    Example:
        >>> token_positions(torch.tensor([[0, 1, 1], [1, 1, 0]]).bool()).tolist()
        [[0, 0, 1], [0, 1, 1]]
    """
    if mask_BP is None:
        return None
    return (mask_BP.long().cumsum(1) - 1).clamp(min=0)


def _right_aligned(batch: PromptBatch) -> PromptBatch:
    """``batch`` with each row's real tokens moved to its front, in order: column p is the row's position p.

    A row runs as its prompt alone wherever its pads are, so its activations are unchanged, only aligned.

    Example:
        >>> _right_aligned(PromptBatch(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]).bool())).tokens.tolist()
        [[5, 6, 0]]
    """
    if batch.mask is None:
        return batch
    order = torch.sort((~batch.mask).to(torch.uint8), dim=1, stable=True).indices  # real columns first
    return PromptBatch(batch.tokens.gather(1, order), batch.mask.gather(1, order))


def _hook_names(hook_names) -> list[str]:
    names = [hook_names] if isinstance(hook_names, (str, AblationTarget)) else list(hook_names)
    return sorted({name.hook_name if isinstance(name, AblationTarget) else name for name in names})


@torch.no_grad()
def mean_reference(model, reference_tokens: TextOrTokens, hook_names: Union[str, AblationTarget, Sequence],
                   reference_mask: Optional[Tensor] = None, padding_side: str = "right", batch_size: int = 8,
                   progress: ProgressArg = False) -> dict[str, Tensor]:
    """The mean activation at each position over reference prompts, pads excluded: {hook name: [1, P, ...]}.

    ``hook_names``: hook names or ``AblationTarget``s. Each prompt is read at its own positions (a
    left-padded row's first real token is position 0); the mean at position p is over the prompts
    that have a p-th token (zeros where none has). Computed ``batch_size`` rows at a time by
    ``experiments.datasets.mean_activations``, never one cache of the whole reference. Pass the
    result as ``reference_means=`` to ``ablation_hooks``, ``run_ablated``, ``ablation_effect``,
    ``per_token_loss_change`` or ``top_predictions_change``.

    Example:
        >>> from experiments.ablation import ablation_effect
        >>> means = mean_reference(model, ["The cat sat on the mat.", "The dog ran."], [AblationTarget("head", 1, 0)])
        >>> means["blocks.1.attn.hook_z"].shape            # [1, the longest reference's positions, n_heads, d_head]
        torch.Size([1, 11, 4, 32])
        >>> effect = ablation_effect(model, ["The cat sat", "The dog"], [AblationTarget("head", 1, 0)], method="mean",
        ...                          reference_means=means)
        >>> effect.columns.tolist()
        ['clean', 'ablated', 'delta']
    """
    batch = _right_aligned(prompt_batch(model, reference_tokens, reference_mask, padding_side))
    return mean_activations(model, batch.tokens, _hook_names(hook_names), batch_size=batch_size, progress=progress,
                            attention_mask=batch.mask)


def _checked_means(reference_means: dict, hook_names: set[str]) -> dict[str, Tensor]:
    """The precomputed means of ``hook_names``, each [1, P, ...]."""
    if not isinstance(reference_means, dict):
        raise InputError(f"reference_means must be a dict {{hook name: mean activation [1, pos, ...]}}, "
                         f"got {type(reference_means).__name__}")
    missing = sorted(hook_names - set(reference_means))
    if missing:
        raise InputError(f"reference_means has no mean for {missing} (it has {sorted(reference_means)}); compute it with "
                         f"mean_reference(model, reference_tokens, targets)")
    for name in hook_names:
        mean = reference_means[name]
        if not isinstance(mean, Tensor) or mean.ndim < 2 or mean.shape[0] != 1:
            shape = tuple(mean.shape) if isinstance(mean, Tensor) else type(mean).__name__
            raise InputError(f"reference_means[{name!r}] must be a tensor [1, pos, ...] (a batch of one), got {shape}")
    return {name: reference_means[name] for name in hook_names}


def _short_reference(method: str, have: int, need: int, detail: str = "") -> InputError:
    return InputError(f"{method} ablation: the reference has {have} positions, fewer than the input's {need}{detail}; "
                      f"give reference prompts at least as long as the input's")


def _mean_value(mean_1P_: Tensor, n_positions: int) -> ValueOf:
    """Writes the mean at each row's own positions (the first ``n_positions`` of the mean are real)."""
    def value(batch: int, pos: int, positions_BP: Optional[Tensor] = None) -> Tensor:
        need = pos if positions_BP is None else int(positions_BP.max()) + 1
        if need > n_positions:
            raise _short_reference("mean", n_positions, need)
        if positions_BP is None:
            return mean_1P_[:, :pos]
        return mean_1P_[0][positions_BP.to(mean_1P_.device)]

    return value


def _resample_value(act_RP_: Tensor, lengths_R: Tensor, shift: int) -> ValueOf:
    """Writes reference row (b + shift) % n_ref at input row b's own positions (rows right-aligned)."""
    n_ref = act_RP_.shape[0]

    def value(batch: int, pos: int, positions_BP: Optional[Tensor] = None) -> Tensor:
        if shift and n_ref < 2:
            raise InputError("resample ablation needs another prompt: pass reference_tokens or a batch of 2+")
        rows = (torch.arange(batch, device=act_RP_.device) + shift) % n_ref
        need = (torch.full((batch,), pos, device=act_RP_.device) if positions_BP is None
                else positions_BP.to(act_RP_.device).max(1).values + 1)
        short = (need > lengths_R.to(act_RP_.device)[rows]).nonzero().flatten()
        if len(short):
            b = int(short[0])
            raise _short_reference("resample", int(lengths_R[rows[b]]), int(need[b]),
                                   f" (input row {b} takes reference row {int(rows[b])})")
        if positions_BP is None:
            return act_RP_[rows, :pos]
        return act_RP_[rows[:, None], positions_BP.to(act_RP_.device)]

    return value


def reference_values(model, hook_names: set[str], method: str, reference_BP: Optional[TextOrTokens],
                     resample_shift: int = 0, *, reference_mask: Optional[Tensor] = None,
                     reference_means: Optional[dict] = None, padding_side: str = "right") -> dict[str, ValueOf]:
    """For each hook: a function ``(batch, pos, positions=None)`` -> replacement activation [batch or 1, pos, ...].

    ``positions`` [batch, pos] is each input column's position in its own prompt (a padded input;
    ``token_positions``); None reads column p as position p. A padded reference is aligned the same
    way, and a mean excludes its pads. ``reference_means`` replaces the reference prompts of "mean".

    Example:
        >>> reference = model.to_tokens(["The cat sat on the mat.", "A dog ran in the park."])
        >>> value_of = reference_values(model, {"blocks.0.attn.hook_z"}, "resample", reference)["blocks.0.attn.hook_z"]
        >>> value_of(2, 5).shape                         # rows 0 and 1 take reference rows 0 and 1, 5 positions
        torch.Size([2, 5, 4, 32])
    """
    hook_names = set(hook_names)
    if method == "mean":
        if reference_means is not None:
            return {name: _mean_value(mean, mean.shape[1])
                    for name, mean in _checked_means(reference_means, hook_names).items()}
        batch = _right_aligned(prompt_batch(model, reference_BP, reference_mask, padding_side))
        means = mean_activations(model, batch.tokens, sorted(hook_names), attention_mask=batch.mask)
        n_positions = batch.tokens.shape[1] if batch.mask is None else int(batch.mask.sum(1).max())
        return {name: _mean_value(means[name], n_positions) for name in hook_names}
    batch = _right_aligned(prompt_batch(model, reference_BP, reference_mask, padding_side))
    layers = [model.layer_of(name) for name in hook_names]
    stop = None if None in layers else max(layers) + 1  # the run stops after the last hooked block
    _, cache = model.run_with_cache(batch.tokens, attention_mask=batch.mask, stop_at_layer=stop,
                                    names_filter=lambda name: name in hook_names)
    n_ref, p_ref = batch.tokens.shape
    lengths_R = torch.full((n_ref,), p_ref) if batch.mask is None else batch.mask.sum(1).cpu()
    return {name: _resample_value(cache[name], lengths_R, resample_shift) for name in hook_names}


