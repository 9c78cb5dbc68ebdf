"""Gradients of a scalar with respect to the activations at hook points: the one gradient-capturing hook.

Legend: B batch, P position, D d_model.

``capturing_gradients(model, names)`` holds the named activations of the runs inside the block in the autograd graph
(through the model's public ``hooks`` context, so the model's call lock is held for the whole block) and
``capture.gradients(objective)`` returns d objective / d each activation, zeros where the objective does not depend
on it. Weights need not require gradients: an activation that is not in the graph yet (frozen weights, or the
first captured point of a run) becomes a leaf there, which cuts no path, since nothing before it was tracked.
With ``cut=True`` every captured activation is its own leaf: the gradient at a point then counts only the paths
that do not pass through another captured point (direct effects, as attribution graphs take them); ``cut`` may
also name the points to cut, the others kept in the graph as without it.

Activation patching's gradient estimate (``experiments.patching.gradient_estimate``) and edge attribution
patching (``experiments.circuits.eap``) take their gradients here.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Collection, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from workbench.errors import InputError


class GradientCapture:
    """The activations at ``names`` of one run, held in the autograd graph, and gradients with respect to them.

    Example:
        >>> capture = GradientCapture(["blocks.0.hook_resid_pre"])
        >>> with torch.enable_grad(), model.hooks(fwd_hooks=capture.hooks()):
        ...     value = model(tokens)[0, -1, 5]
        ...     grads = capture.gradients(value)
        >>> grads["blocks.0.hook_resid_pre"].shape == capture.activations["blocks.0.hook_resid_pre"].shape
        True

    Cutting only some points (``cut`` names them): the gradient at the cut point counts no path through the other.
        >>> names = ["blocks.0.hook_resid_pre", "blocks.0.hook_resid_post"]
        >>> capture = GradientCapture(names, cut=["blocks.0.hook_resid_post"])
        >>> with torch.enable_grad(), model.hooks(fwd_hooks=capture.hooks()):
        ...     value = model(tokens, stop_at_layer=1).sum()
        ...     grads = capture.gradients(value)
        >>> float(grads["blocks.0.hook_resid_pre"].abs().sum()), float(grads["blocks.0.hook_resid_post"][0, 0, 0])
        (0.0, 1.0)
    """

    def __init__(self, names: Sequence[str], *, cut: Union[bool, Collection[str]] = False):
        self.names = list(dict.fromkeys(names))
        if not isinstance(cut, bool):
            cut = {cut} if isinstance(cut, str) else set(cut)
            unknown = sorted(cut - set(self.names))
            if unknown:
                raise InputError(f"cut names {', '.join(unknown)}, which are not among the captured points")
        self.cut = cut
        self.activations: dict[str, Tensor] = {}

    def _cuts(self, name: str) -> bool:
        return self.cut if isinstance(self.cut, bool) else name in self.cut

    def hooks(self) -> list[tuple[str, Callable]]:
        """Forward hooks that keep each named activation (a leaf where it is not in the graph, or always where
        ``cut``); they go after any hook that edits the same point, so what they keep is what the run goes on with."""
        def keep(name: str) -> Callable:
            def hook(activation: Tensor, hook: Any) -> Tensor:
                if self._cuts(name) or not activation.requires_grad:
                    activation = activation.detach().requires_grad_(True)
                self.activations[name] = activation
                return activation
            return hook
        return [(name, keep(name)) for name in self.names]

    def gradients(self, outputs: Union[Tensor, Sequence[Tensor]], grad_outputs: Optional[Sequence[Tensor]] = None, *,
                  retain_graph: bool = False) -> dict[str, Tensor]:
        """d ``outputs`` / d each captured activation ({name: tensor shaped like the activation}; zeros where the
        outputs do not depend on it). ``outputs`` is a scalar, or tensors weighted by ``grad_outputs``
        (``torch.autograd.grad``'s vector-Jacobian product); ``retain_graph`` keeps the graph for another call.

        Example:
            >>> with capturing_gradients(model, ["blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]) as capture:
            ...     resid = model(tokens, stop_at_layer=1)              # layer 1 never runs
            ...     grads = capture.gradients(resid.sum())
            Traceback (most recent call last):
            ...
            workbench.errors.InputError: no run captured blocks.1.hook_resid_pre, blocks.1.hook_resid_post: ...
        """
        missing = [name for name in self.names if name not in self.activations]
        if missing:
            raise InputError(f"no run captured {', '.join(missing)}: run the model inside the block, through the "
                             f"layers those hook points belong to, before asking for gradients")
        inputs = [self.activations[name] for name in self.names]
        found = torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph, allow_unused=True)
        return {name: torch.zeros_like(act) if grad is None else grad
                for name, act, grad in zip(self.names, inputs, found)}


@contextmanager
def capturing_gradients(model, names: Sequence[str], *, fwd_hooks: Sequence[tuple[str, Callable]] = (),
                        cut: Union[bool, Collection[str]] = False) -> Iterator[GradientCapture]:
    """A block in which runs of ``model`` keep the activations at ``names`` for ``capture.gradients``, with
    ``fwd_hooks`` (edits such as an interpolated input) attached before the capturing hooks, and ``cut`` as in
    ``GradientCapture``; gradients on, every
    hook removed and the model's call lock released at the end, even on an error.

    Example:
        >>> with capturing_gradients(model, ["blocks.0.attn.hook_z"]) as capture:
        ...     logits = model(tokens)
        ...     grads = capture.gradients(logits[0, -1, 5] - logits[0, -1, 7])
        >>> grads["blocks.0.attn.hook_z"].shape                         # [batch, pos, head, d_head]
        torch.Size([1, 14, 4, 32])
        >>> model.attached_hooks()
        {}
    """
    capture = GradientCapture(names, cut=cut)
    with torch.enable_grad(), model.hooks(fwd_hooks=list(fwd_hooks) + capture.hooks()):
        yield capture
