"""Editing one feature during a forward pass or a generation: steering (add ``alpha`` times its decoder
direction where the SAE writes), clamping (set its activation) and ablation (clamp to zero), as
``(hook name, hook)`` pairs for ``run_with_hooks``, ``model.hooks`` and ``generate``.

Steering needs no SAE in the model: it adds ``alpha * W_dec[feature]`` to the model's activation at the hook
the SAE writes (SAELens's steering recipe). Clamping edits ``hook_sae_acts_post``, so the SAE must be spliced
in: ``with model.saes(saes=[sae], use_error_term=True)`` keeps everything else exact, and the output moves by
the decoded change of that one feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from experiments._tokens import str_tokens
from workbench.tokens_api import TextOrTokens
from experiments.continuations import Continuations, continue_under_hooks, first_divergence
from experiments.features.activations import acts_hook_name, check_feature, check_fits
from experiments.metrics import prompt_batch
from workbench.errors import InputError
from workbench.sae import SAE

Hook = tuple[str, Callable[[Tensor, object], Tensor]]
MODES = ("add", "clamp")


def steering_hook(sae: SAE, feature: int, alpha: float) -> Hook:
    """A hook on the point ``sae`` writes that adds ``alpha * W_dec[feature]`` at every position (a ``hook_z``
    SAE's row reshaped to heads; a one-head SAE's added to that head).

    Example:
        >>> _ = torch.manual_seed(0); sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=4,
        ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.zeros(128, 4),
        ...     "W_dec": torch.randn(4, 128), "b_enc": torch.zeros(4), "b_dec": torch.zeros(128)})
        >>> name, steer = steering_hook(sae, 1, alpha=3.0)
        >>> with model.hooks(fwd_hooks=[(name, steer)]):
        ...     _, steered = model.run_with_cache(tokens, names_filter=[name])
        >>> name, torch.allclose(steered[name] - cache[name], 3.0 * sae.W_dec[1].detach(), atol=1e-5)
        ('blocks.0.hook_resid_post', True)
    """
    check_feature(sae, feature)
    alpha = _finite(alpha, "alpha")
    direction = sae.W_dec[feature].detach().clone()
    head = sae.cfg.metadata.hook_head_index

    def steer(activation: Tensor, hook: object) -> Tensor:
        change = alpha * direction.to(device=activation.device, dtype=activation.dtype)
        if head is not None:  # a one-head SAE: that head's d_head only
            out = activation.clone()
            out[..., head, :] += change
            return out
        return activation + change.reshape(activation.shape[2:])  # hook_z: heads x d_head again

    return sae.cfg.hook_name_out, steer


def clamp_hook(sae: SAE, feature: int, value: float) -> Hook:
    """A hook on the spliced SAE's ``hook_sae_acts_post`` that sets ``feature``'s activation to ``value`` at every
    position. Use it while the SAE is spliced (``with model.saes(saes=[sae], use_error_term=True)``).

    Example:
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=4,
        ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.randn(128, 4),
        ...     "W_dec": torch.randn(4, 128), "b_enc": torch.zeros(4), "b_dec": torch.zeros(128)})
        >>> name, clamp = clamp_hook(sae, 2, 5.0)
        >>> with model.saes(saes=[sae], use_error_term=True), model.hooks(fwd_hooks=[(name, clamp)]):
        ...     _, edited = model.run_with_cache(tokens, names_filter=[name])
        >>> name, edited[name][..., 2].unique().tolist()
        ('blocks.0.hook_resid_post.hook_sae_acts_post', [5.0])
    """
    check_feature(sae, feature)
    value = _finite(value, "value")

    def clamp(acts: Tensor, hook: object) -> Tensor:
        out = acts.clone()
        out[..., feature] = value
        return out

    return acts_hook_name(sae), clamp


def ablation_hook(sae: SAE, feature: int) -> Hook:
    """``clamp_hook(sae, feature, 0.0)``: the feature switched off (with the SAE spliced in).

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> ablation_hook(sae, 3)[0]
        'blocks.0.hook_resid_post.hook_sae_acts_post'
    """
    return clamp_hook(sae, feature, 0.0)


def _finite(value: float, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number, got {value!r}") from None
    if not torch.isfinite(torch.tensor(number)):
        raise InputError(f"{name} must be finite, got {value!r}")
    return number


@dataclass(frozen=True)
class FeatureEdit:
    """One feature edited: ``mode`` "add" (steer by ``value`` times its decoder direction) or "clamp" (set its
    activation to ``value``; 0 ablates it).

    Example:
        >>> FeatureEdit(12, "add", 8.0).label, FeatureEdit(3, "clamp", 0.0).label
        ('feature 12 + 8 x W_dec', 'feature 3 clamped to 0')
    """

    feature: int
    mode: str = "add"
    value: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def label(self) -> str:
        if self.mode == "add":
            return f"feature {self.feature} + {self.value:g} x W_dec"
        return f"feature {self.feature} clamped to {self.value:g}"

    def hook(self, sae: SAE) -> Hook:
        """The edit's hook (``steering_hook`` or ``clamp_hook``)."""
        if self.mode == "add":
            return steering_hook(sae, self.feature, self.value)
        return clamp_hook(sae, self.feature, self.value)


@torch.no_grad()
def continue_with_feature(model, sae: SAE, prompt: TextOrTokens, edit: FeatureEdit, max_new_tokens: int = 20,
                          temperature: float = 0.0, top_k: Optional[int] = None, seed: Optional[int] = 0) -> Continuations:
    """The clean continuation of ``prompt`` beside the one with ``edit`` applied at every step (same settings
    and seed; the KV cache on, as the edit does not depend on the position). A clamp runs with the SAE spliced
    in with its error term. ``Continuations.ablated_*`` holds the edited run; ``method`` is the edit's mode.

    Example:
        >>> _ = torch.manual_seed(0); sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=4,
        ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.zeros(128, 4),
        ...     "W_dec": torch.randn(4, 128), "b_enc": torch.zeros(4), "b_dec": torch.zeros(128)})
        >>> result = continue_with_feature(model, sae, "The cat sat on the mat. The cat", FeatureEdit(0, "add", 40.0),
        ...                                max_new_tokens=4)
        >>> len(result.clean_tokens), result.targets, result.first_divergence is not None
        (4, ('feature 0 + 40 x W_dec',), True)
    """
    if not isinstance(edit, FeatureEdit):
        raise InputError(f"edit must be a FeatureEdit, got {type(edit).__name__}")
    hook = edit.hook(sae)
    batch = prompt_batch(model, prompt)
    if batch.size != 1 or batch.mask is not None:
        raise InputError(f"continue_with_feature continues one prompt, got {batch.size} rows")
    tokens_1P = batch.tokens
    check_fits(model, sae)
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    clean_P, clean_lp = continue_under_hooks(model, tokens_1P, [], **settings)
    if edit.mode == "clamp":
        with model.saes(saes=[sae], use_error_term=True):
            edited_P, edited_lp = continue_under_hooks(model, tokens_1P, [hook], **settings)
    else:
        edited_P, edited_lp = continue_under_hooks(model, tokens_1P, [hook], **settings)
    clean_ids, edited_ids = tuple(clean_P.tolist()), tuple(edited_P.tolist())
    return Continuations(
        prompt_tokens=tuple(tokens_1P[0].tolist()), clean_tokens=clean_ids, ablated_tokens=edited_ids,
        clean_str_tokens=tuple(str_tokens(model, clean_P)), ablated_str_tokens=tuple(str_tokens(model, edited_P)),
        clean_logprobs=tuple(clean_lp.tolist()), ablated_logprobs=tuple(edited_lp.tolist()),
        first_divergence=first_divergence(clean_ids, edited_ids), method=edit.mode, targets=(edit.label,))
