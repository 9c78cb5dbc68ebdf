"""Matryoshka batch-top-k (Bussmann et al. 2025; SAELens's ``MatryoshkaBatchTopKTrainingSAE``): a training form
only. Batch-top-k's activation, running threshold and aux-k loss, plus one reconstruction loss per inner level of
``matryoshka_widths``: the prefix of the first ``width`` features alone (with ``b_dec``) must reconstruct the
target too (``inner_mse_loss_{width}``, SAELens's names; the outer level is the usual ``mse_loss``). Saved as
``jumprelu`` (as SAELens saves it), so this module adds no row to the table.

``use_matryoshka_aux_loss`` (SAELens's option, default False) replaces the one aux-k loss on the whole SAE's
residual by one per level: each level's dead features (its slice of ``d_sae``; the outer level included)
reconstruct the detached residual of the decode up to that level (``b_dec`` and the features of every level up to
it), each term scaled by that level's own ``min(n_dead / (d_out // 2), 1)``; the terms are summed (not averaged)
and times ``aux_loss_coefficient``, as ``aux_loss`` (SAELens's ``calculate_matryoshka_aux_loss``).

Legend: N flattened tokens, X d_sae, o d_out.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from jaxtyping import Float
from torch import Tensor

from workbench.errors import InputError
from workbench.sae.architectures.base import SparseDecode
from workbench.sae.architectures.batchtopk import BatchTopKTraining
from workbench.sae.architectures.topk import aux_k_loss


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

    Example (two levels of one feature each; the inner one alone reconstructs row 0 exactly, not row 1; with
    ``use_matryoshka_aux_loss`` the outer level's one dead feature, pre-activations 0.5 and 1, rebuilds that
    level's residual, 0: aux_loss (0.5 ** 2 + 1 ** 2) / 2, scale min(1 dead / (2 // 2), 1) = 1):
        >>> form, acts = MatryoshkaBatchTopKTraining(), torch.tensor([[1.0, 0.0], [1.0, 1.0]])
        >>> hidden_pre, dead = torch.tensor([[1.0, 0.5], [1.0, 1.0]]), torch.tensor([False, True])
        >>> decode = lambda indices, values: torch.nn.functional.embedding_bag(indices, torch.eye(2),
        ...                                                                     per_sample_weights=values, mode="sum")
        >>> form.nested_losses(acts, hidden_pre, acts, dead, torch.eye(2), torch.zeros(2), decode,
        ...                    {"matryoshka_widths": (1, 2)}, rescale=False)
        {'inner_mse_loss_1': tensor(0.5000)}
        >>> form.nested_losses(acts, hidden_pre, acts, dead, torch.eye(2), torch.zeros(2), decode,
        ...                    {"matryoshka_widths": (1, 2), "use_matryoshka_aux_loss": True}, rescale=False)
        {'inner_mse_loss_1': tensor(0.5000), 'aux_loss': tensor(0.6250)}
    """

    name = "matryoshka_batchtopk"
    saved_as = ("jumprelu", None, None)

    def new_state(self, layers: tuple[int, ...], d_sae: int, options: Mapping[str, Any]) -> dict[str, Tensor]:
        k = options.get("k")
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= d_sae:
            raise InputError(f"k must be a number of features from 1 to d_sae={d_sae} for a matryoshka_batchtopk SAE, "
                             f"got {k!r}")
        matryoshka_levels(options.get("matryoshka_widths"), d_sae)
        if not isinstance(options.get("use_matryoshka_aux_loss", False), bool):
            raise InputError(f"use_matryoshka_aux_loss must be True or False, got "
                             f"{options['use_matryoshka_aux_loss']!r}")
        return super().new_state(layers, d_sae, options)

    def auxiliary_loss(self, hidden_pre: Float[Tensor, "N X"], residual: Float[Tensor, "N o"], dead: Tensor,
                       decode_sparse: SparseDecode, options: Mapping[str, Any]) -> dict[str, Tensor]:
        if options.get("use_matryoshka_aux_loss", False):
            return {}  # one term per level, in nested_losses: it needs each level's decode
        return super().auxiliary_loss(hidden_pre, residual, dead, decode_sparse, options)

    def nested_losses(self, acts: Float[Tensor, "N X"], hidden_pre: Float[Tensor, "N X"], target: Float[Tensor, "N o"],
                      dead: Tensor, W_dec: Float[Tensor, "X o"], b_dec: Float[Tensor, "o"], decode_sparse: SparseDecode,
                      options: Mapping[str, Any], rescale: bool) -> dict[str, Tensor]:
        # SAELens's _iterable_decode: each level adds its slice of features to the previous level's decode
        if rescale:
            acts = acts * (1 / W_dec.norm(dim=-1))
        levels = matryoshka_levels(options["matryoshka_widths"], W_dec.shape[0])
        per_level_aux = options.get("use_matryoshka_aux_loss", False)
        losses, aux_terms, decoded, start = {}, [], b_dec, 0
        for width in levels if per_level_aux else levels[:-1]:
            decoded = acts[:, start:width] @ W_dec[start:width] + decoded
            if width < levels[-1]:  # the outer level is the whole SAE: its loss is mse_loss
                losses[f"inner_mse_loss_{width}"] = (decoded - target).pow(2).sum(-1).mean()
            if per_level_aux:  # this level's dead features rebuild what the levels up to it leave
                aux_terms.append(aux_k_loss(hidden_pre[:, start:width], target - decoded, dead[start:width],
                                            lambda i, v, start=start: decode_sparse(i + start, v)))
            start = width
        if per_level_aux:
            losses["aux_loss"] = options.get("aux_loss_coefficient", 1.0) * torch.stack(aux_terms).sum()
        return losses

    def inference_config(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return {}


SPECS = ()
TRAINING = (MatryoshkaBatchTopKTraining(),)
