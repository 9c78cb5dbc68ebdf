"""A prompt's clean continuation beside its continuation with a steering vector applied (same settings and seed),
as ``experiments.continuations.Continuations`` (its ``ablated_*`` fields hold the steered run)."""

from __future__ import annotations

from typing import Optional

import torch

from experiments._tokens import str_tokens
from experiments.continuations import Continuations, continue_under_hooks, first_divergence
from experiments.metrics import prompt_batch
from experiments.steering.vector import SteeringVector
from workbench.errors import InputError
from workbench.tokens_api import TextOrTokens


@torch.no_grad()
def continue_with_vector(model, vector: SteeringVector, prompt: TextOrTokens, multiplier: float = 1.0,
                         max_new_tokens: int = 20, temperature: float = 0.0, top_k: Optional[int] = None,
                         seed: Optional[int] = 0, extra_hooks: tuple = ()) -> Continuations:
    """Clean and steered continuations of one prompt; ``extra_hooks`` (e.g. an SAE feature's ``steering_hook``) are
    applied with the vector. Every position is steered, so the KV cache stays on.

    Example:
        >>> vector = SteeringVector({0: torch.randn(128)})
        >>> result = continue_with_vector(model, vector, "The cat sat on the mat. The cat", 30.0, max_new_tokens=4)
        >>> len(result.clean_tokens), result.method, result.first_divergence is not None
        (4, 'steering', True)
    """
    if not isinstance(vector, SteeringVector):
        raise InputError(f"vector must be a SteeringVector, got {type(vector).__name__}")
    hooks = vector.hooks(model, multiplier) + list(extra_hooks)   # checked before anything runs
    batch = prompt_batch(model, prompt)
    if batch.size != 1 or batch.mask is not None:
        raise InputError(f"continue_with_vector continues one prompt, got {batch.size} rows")
    tokens_1P = batch.tokens
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    clean_P, clean_lp = continue_under_hooks(model, tokens_1P, [], **settings)
    steered_P, steered_lp = continue_under_hooks(model, tokens_1P, hooks, **settings)
    clean_ids, steered_ids = tuple(clean_P.tolist()), tuple(steered_P.tolist())
    layers = ", ".join(str(layer) for layer in sorted(vector.layer_activations))
    return Continuations(
        prompt_tokens=tuple(tokens_1P[0].tolist()), clean_tokens=clean_ids, ablated_tokens=steered_ids,
        clean_str_tokens=tuple(str_tokens(model, clean_P)), ablated_str_tokens=tuple(str_tokens(model, steered_P)),
        clean_logprobs=tuple(clean_lp.tolist()), ablated_logprobs=tuple(steered_lp.tolist()),
        first_divergence=first_divergence(clean_ids, steered_ids), method="steering",
        targets=(f"vector x {float(multiplier):g} at layers {layers}",))
