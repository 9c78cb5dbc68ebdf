"""Matryoshka batch-top-k (Bussmann et al. 2025; SAELens's ``MatryoshkaBatchTopKTrainingSAE``): a training form
only. Batch-top-k's activation, running threshold and aux-k loss, plus one reconstruction loss per inner level of
``matryoshka_widths``: the prefix of the first ``width`` features alone (with ``b_dec``) must reconstruct the
target too (``inner_mse_loss_{width}``, SAELens's names; the outer level is the usual ``mse_loss``). Saved as
``jumprelu`` (as SAELens saves it), so this module adds no row to the table.

Legend: N flattened tokens, X d_sae, o d_out.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from jaxtyping import Float
from torch import Tensor

from workbench.errors import InputError
from workbench.sae.architectures.batchtopk import BatchTopKTraining


def matryoshka_levels(widths: Any, d_sae: int) -> tuple[int, ...]:
    """The levels' widths, strictly increasing and ending at ``d_sae`` (appended when missing, as SAELens does);
    an ``InputError`` naming ``matryoshka_widths`` otherwise.

    Example:
        >>> matryoshka_levels((8, 32), 64)
        (8, 32, 64)
    """
    if isinstance(widths, (str, bytes)) or not hasattr(widths, "__iter__"):
        raise InputError(f"matryoshka_widths must be a list of increasing widths up to d_sae={d_sae}, got {widths!r}")
    levels = list(widths)
    if not levels or any(isinstance(w, bool) or not isinstance(w, int) or not 0 < w <= d_sae for w in levels):
        raise InputError(f"matryoshka_widths must be a non-empty list of widths from 1 to d_sae={d_sae}, got {widths!r}")
    if levels[-1] != d_sae:
        levels.append(d_sae)
    if any(a >= b for a, b in zip(levels, levels[1:])):
        raise InputError(f"matryoshka_widths must be strictly increasing, got {widths!r}")
    return tuple(levels)


class MatryoshkaBatchTopKTraining(BatchTopKTraining):
    """Batch-top-k with nested prefix reconstruction losses, saved as JumpReLU.

    Example (two levels of one feature each; the inner one alone reconstructs row 0 exactly, not row 1):
        >>> form = MatryoshkaBatchTopKTraining()
        >>> losses = form.nested_losses(torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[1.0, 0.0], [1.0, 1.0]]),
        ...                             torch.eye(2), torch.zeros(2), {"matryoshka_widths": (1, 2)}, rescale=False)
        >>> losses
        {'inner_mse_loss_1': tensor(0.5000)}
    """

    name = "matryoshka_batchtopk"
    saved_as = ("jumprelu", None, None)

    def new_state(self, layers: tuple[int, ...], d_sae: int, options: Mapping[str, Any]) -> dict[str, Tensor]:
        k = options.get("k")
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= d_sae:
            raise InputError(f"k must be a number of features from 1 to d_sae={d_sae} for a matryoshka_batchtopk SAE, "
                             f"got {k!r}")
        matryoshka_levels(options.get("matryoshka_widths"), d_sae)
        return super().new_state(layers, d_sae, options)

    def nested_losses(self, acts: Float[Tensor, "N X"], target: Float[Tensor, "N o"], W_dec: Float[Tensor, "X o"],
                      b_dec: Float[Tensor, "o"], options: Mapping[str, Any], rescale: bool) -> dict[str, Tensor]:
        # SAELens's _iterable_decode: each inner level adds its slice of features to the previous level's decode
        if rescale:
            acts = acts * (1 / W_dec.norm(dim=-1))
        levels = matryoshka_levels(options["matryoshka_widths"], W_dec.shape[0])
        losses, decoded, start = {}, b_dec, 0
        for width in levels[:-1]:  # the outer level is the whole SAE: its loss is mse_loss
            decoded = acts[:, start:width] @ W_dec[start:width] + decoded
            losses[f"inner_mse_loss_{width}"] = (decoded - target).pow(2).sum(-1).mean()
            start = width
        return losses

    def inference_config(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return {}


SPECS = ()
TRAINING = (MatryoshkaBatchTopKTraining(),)
