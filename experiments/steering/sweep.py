"""A coefficient sweep: a behaviour measure of the steered model at each multiplier.

A measure is a function ``measure(model, tokens_BP) -> [B]`` run while the vector is applied; three are given:
``logit_difference`` (a token's logit minus another's at the last position), ``token_probability`` (the summed
probability of a token set at the last position) and ``direction_score`` (the projection of an activation at the
last position onto a probe-like direction). ``experiments.plots.steering.sweep_figure`` draws the result.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import pandas as pd
import torch
from torch import Tensor

from experiments.metrics import prompt_batch, token_ids
from experiments.steering.vector import SteeringVector, TokenIndices, _finite
from workbench.errors import InputError

Measure = Callable[[object, Tensor], Tensor]


def _last_logits(model, tokens_BP: Tensor) -> Tensor:
    return model(tokens_BP)[:, -1].float()


def logit_difference(good: Union[int, str], bad: Union[int, str]) -> Measure:
    """The measure ``logit[good] - logit[bad]`` at each prompt's last position.

    Example:
        >>> measure = logit_difference(" on", " the")          # ids 542 and 293
        >>> clean = model(tokens)
        >>> torch.allclose(measure(model, tokens), clean[:, -1, 542] - clean[:, -1, 293])
        True
    """
    @torch.no_grad()
    def measure(model, tokens_BP: Tensor) -> Tensor:
        ids = token_ids(model, [good, bad], 2, "tokens")
        last_BV = _last_logits(model, tokens_BP)
        return last_BV[:, ids[0]] - last_BV[:, ids[1]]
    measure.label = f"logit({good!r}) - logit({bad!r})"
    return measure


def token_probability(tokens: Sequence[Union[int, str]]) -> Measure:
    """The measure "probability of any of ``tokens`` next" at each prompt's last position.

    Example:
        >>> p = token_probability([" the", " on"])(model, tokens)
        >>> p.shape, bool((p > 0).all() and (p < 1).all())
        (torch.Size([1]), True)
    """
    tokens = list(tokens)
    if not tokens:
        raise InputError("token_probability needs at least one token")

    @torch.no_grad()
    def measure(model, tokens_BP: Tensor) -> Tensor:
        ids = token_ids(model, tokens, len(tokens), "tokens").unique()
        return _last_logits(model, tokens_BP).softmax(dim=-1)[:, ids].sum(dim=-1)
    measure.label = f"P({', '.join(repr(t) for t in tokens)})"
    return measure


def direction_score(direction: Tensor, hook_name: str) -> Measure:
    """The measure "activation at ``hook_name`` (last position) projected onto ``direction``": a probe's score.

    Example:
        >>> score = direction_score(torch.ones(128), "blocks.1.hook_resid_post")(model, tokens)
        >>> torch.allclose(score, cache["blocks.1.hook_resid_post"][:, -1].sum(-1), atol=1e-4)
        True
    """
    if not isinstance(direction, Tensor) or direction.ndim != 1:
        raise InputError("direction must be a 1-D tensor")

    @torch.no_grad()
    def measure(model, tokens_BP: Tensor) -> Tensor:
        model.check_hook_names([hook_name])
        _, cache = model.run_with_cache(tokens_BP, names_filter=[hook_name], return_type=None, progress=False)
        acts_BD = cache[hook_name][:, -1].float()
        if acts_BD.shape[-1] != direction.shape[0]:
            raise InputError(f"direction has {direction.shape[0]} entries but {hook_name} has {acts_BD.shape[-1]}")
        return acts_BD @ direction.to(acts_BD.device).float()
    measure.label = f"score along a direction at {hook_name}"
    return measure


@torch.no_grad()
def coefficient_sweep(model, vector: SteeringVector, prompts, measure: Measure, coefficients: Sequence[float],
                      token_indices: TokenIndices = None) -> pd.DataFrame:
    """One row per coefficient and prompt: ``coefficient``, ``prompt`` (its index) and ``score`` (the measure
    with the vector applied at that multiplier). Prompts of different lengths are measured one at a time.

    Example:
        >>> vector = SteeringVector({0: torch.randn(128)})
        >>> measure = logit_difference(" on", " the")
        >>> table = coefficient_sweep(model, vector, "The cat sat on the mat. The cat", measure, [0.0, 1.0])
        >>> table.columns.tolist(), len(table), bool(table.score.iloc[0] == float(measure(model, tokens)[0]))
        (['coefficient', 'prompt', 'score'], 2, True)
    """
    values = [_finite(c, "coefficient") for c in coefficients]
    if not values:
        raise InputError("coefficients is empty")
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    batches = [prompt_batch(model, text).tokens for text in texts]
    vector.hooks(model)   # checked once, before any run
    rows = []
    for value in values:
        with vector.apply(model, multiplier=value, token_indices=token_indices):
            for index, tokens_BP in enumerate(batches):
                rows.append((value, index, float(measure(model, tokens_BP)[0])))
    return pd.DataFrame(rows, columns=["coefficient", "prompt", "score"])
