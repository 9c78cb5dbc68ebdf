"""Feature interventions: set transcoder features to new values and read the logits, circuit-tracer 0.5's
``feature_intervention`` on our public hooks.

An intervention ``(layer, position, feature, value)`` adds ``(value - current activation) * W_dec[feature]`` to what
that layer writes (to every later layer too for a cross-layer transcoder). ``freeze_attention`` keeps the prompt's
attention patterns (``ReplacementModel.freeze_hooks``, as ``attribute`` freezes them). Without ``constrained_layers`` the change propagates through the real MLPs (the activations
read then are the transcoders' on the changed inputs). With ``constrained_layers`` the MLP outputs of those layers
stay at their clean values (plus the change of a skip term) and only the interventions' decoded changes are added;
constrained to every layer, the norm divisors freeze too, so the result is the direct effect the graph's edges
give (``apply_activation_function=False`` returns pre-activations, which the edges predict).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from experiments.attribution.attribute import Prompt, prompt_tokens
from experiments.attribution.replacement import ReplacementModel
from workbench.errors import InputError
from workbench.transcoders import TranscoderSet

Intervention = tuple[int, Union[int, slice], int, Union[float, Tensor]]


class InterventionResult(NamedTuple):
    """The logits of the intervened run and the transcoders' activations (or pre-activations) in it."""

    logits: Float[Tensor, "pos d_vocab"]
    activations: Float[Tensor, "layer pos d_transcoder"]


def _check(interventions: Sequence[Intervention], tc: TranscoderSet, n_pos: int) -> None:
    for item in interventions:
        if not (isinstance(item, (tuple, list)) and len(item) == 4):
            raise InputError(f"an intervention is (layer, position, feature, value), got {item!r}")
        layer, pos, feature, _ = item
        if not isinstance(layer, int) or not 0 <= layer < tc.n_layers:
            raise InputError(f"intervention layer must be in [0, {tc.n_layers}), got {layer!r}")
        if not isinstance(feature, int) or not 0 <= feature < tc.d_transcoder:
            raise InputError(f"intervention feature must be in [0, {tc.d_transcoder}), got {feature!r}")
        if not isinstance(pos, slice) and (not isinstance(pos, int) or not -n_pos <= pos < n_pos):
            raise InputError(f"intervention position must be a position of the {n_pos}-token prompt or a slice, "
                             f"got {pos!r}")


@torch.no_grad()
def intervene(model: Any, transcoders: Optional[TranscoderSet], prompt: Prompt, interventions: Sequence[Intervention],
              constrained_layers: Optional[Sequence[int]] = None, freeze_attention: bool = True,
              apply_activation_function: bool = True) -> InterventionResult:
    """The logits and transcoder activations of ``prompt`` with ``interventions`` applied (see the module
    docstring; the prompt is read as ``attribute`` reads it, BOS first). ``model`` may be a ``ReplacementModel``
    (``transcoders`` then None).

    Example:
        >>> intervene(model, None, "The cat", [])
        Traceback (most recent call last):
        workbench.errors.InputError: intervene needs a wb.TranscoderSet (wb.load_transcoders), got NoneType
    """
    replacement = ReplacementModel.of(model, transcoders, caller="intervene")
    model, tc = replacement.model, replacement.transcoders
    tokens = prompt_tokens(model, prompt)
    n_layers, n_pos = tc.n_layers, tokens.shape[0]
    _check(interventions, tc, n_pos)
    constrained = sorted(set(constrained_layers)) if constrained_layers else []
    by_layer: dict[int, list] = defaultdict(list)
    for layer, pos, feature, value in interventions:
        by_layer[layer].append((pos, feature, value))

    def encode(layer: int, x: Tensor, activate: bool) -> Tensor:
        acts = tc.encode(layer, x) if activate else tc.pre_activations(layer, x)
        acts[0] = 0   # circuit-tracer zeroes the first position, here too
        return acts

    clean: dict[str, Tensor] = {}
    original: dict[int, Tensor] = {}
    freezing = bool(constrained) or (freeze_attention and bool(interventions))   # constrained MLPs read the clean run
    freeze_scales = set(range(n_layers)) <= set(constrained)
    if freezing:
        clean = replacement.record(tokens)
        original = {l: encode(l, clean[tc.input_hook(l)][0], True) for l in range(n_layers)}

    deltas = torch.zeros(n_layers, n_pos, tc.d_model, dtype=replacement.dtype, device=replacement.device)
    inputs: dict[int, Tensor] = {}
    acts: dict[int, Tensor] = {}

    def read(layer: int):
        def hook(x: Tensor, hook: Any) -> None:
            inputs[layer] = x[0]
            acts[layer] = encode(layer, x[0], apply_activation_function)
        return hook

    def write(layer: int):
        def hook(out: Tensor, hook: Any) -> Tensor:
            if layer in constrained:   # the clean output, with the skip term's change
                out = replacement.mlp_output(layer, inputs[layer], clean[hook.name][0], clean[tc.input_hook(layer)][0])[None]
            if by_layer.get(layer):
                base = original[layer] if constrained else acts[layer]
                if not constrained and not apply_activation_function:
                    base = tc.activate(layer, base)
                change = torch.zeros_like(base)
                for pos, feature, value in by_layer[layer]:
                    change[pos, feature] = value - base[pos, feature]
                deltas.add_(replacement.decode(layer, change))
            if not constrained or layer in constrained:
                out = out + deltas[layer].to(out.dtype)
                deltas[layer] = 0
            return out
        return hook

    hooks = replacement.freeze_hooks(clean, scales=freeze_scales) if freezing else []
    hooks += [(tc.input_hook(l), read(l)) for l in range(n_layers)]
    hooks += [(tc.output_hook(l), write(l)) for l in range(n_layers)]
    logits = model.run_with_hooks(tokens[None], fwd_hooks=hooks)
    return InterventionResult(logits[0], torch.stack([acts[l] for l in range(n_layers)]))
