"""Matching pursuit (SAELens's ``MatchingPursuitSAE``): a tied SAE whose codes are chosen greedily, one feature per
step, from the residual of what is chosen so far.

Legend: N flattened tokens, i d_in, X d_sae.

The decoder is the only matrix (``W_enc`` is ``W_dec`` transposed, not stored; no ``b_enc``). From the centred,
normalised input, each step takes the feature whose decoder row has the largest ReLU'd inner product with the
residual, adds that product (ReLU'd) to its code and subtracts it times the row from the residual. A row stops
(its later steps add nothing) once its support is the same as the step before (``stop_on_duplicate_support``) or
its residual's norm is below ``residual_threshold`` (when positive); every row stops after ``max_iterations``
steps (``d_in`` when null). The decode adds ``b_dec`` only when ``apply_b_dec_to_input`` (it is the input's
centre, as SAELens). There is no pre-activation: ``hook_sae_acts_pre`` never fires. Inference only.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from jaxtyping import Float
from torch import Tensor, nn

from workbench.errors import ConfigError, InputError
from workbench.sae.architectures.base import Encoding, HookFn, rows


def matching_pursuit(x: Float[Tensor, "... i"], W_dec: Float[Tensor, "X i"], residual_threshold: float,
                     max_iterations: Optional[int], stop_on_duplicate_support: bool) -> Float[Tensor, "... X"]:
    """The codes of ``x`` (centred) by greedy matching pursuit over ``W_dec``'s rows (SAELens's
    ``_encode_matching_pursuit``, step for step).

    Example (orthogonal rows: one step per direction, then the support repeats):
        >>> matching_pursuit(torch.tensor([[2.0, 3.0]]), torch.eye(2), 0.0, None, True)
        tensor([[2., 3.]])
    """
    residual = x.reshape(-1, x.shape[-1]).clone()
    rows_n, (d_sae, d_in) = residual.shape[0], W_dec.shape
    codes = torch.zeros(rows_n, d_sae, dtype=residual.dtype, device=W_dec.device)
    previous = torch.zeros(rows_n, d_sae, dtype=torch.bool, device=W_dec.device)
    done = torch.zeros(rows_n, dtype=torch.bool, device=W_dec.device)
    for _ in range(d_in if max_iterations is None else max_iterations):
        with torch.no_grad():  # the choice needs no gradient
            chosen = (residual @ W_dec.T).relu().max(dim=1, keepdim=True).indices
        rows_chosen = W_dec[chosen.squeeze(1)]
        values = (residual * rows_chosen).sum(dim=-1, keepdim=True).relu() * (~done).unsqueeze(1).to(residual.dtype)
        values = values.to(codes.dtype)
        codes = codes.scatter_add(1, chosen, values)
        residual = residual - values * rows_chosen
        if stop_on_duplicate_support or residual_threshold > 0:
            with torch.no_grad():
                support = codes != 0
                if stop_on_duplicate_support:
                    done = done | (support == previous).all(dim=1)
                    previous = support
                if residual_threshold > 0:
                    done = done | (residual.norm(dim=-1) < residual_threshold)
                if done.all():
                    break
    return codes.reshape(*x.shape[:-1], d_sae)


class MatchingPursuit(Encoding):
    """Greedy codes over the tied decoder; no bias, no pre-activation.

    Example (tied: W_enc is not stored; a negative threshold is refused):
        >>> cfg = wb.SAEConfig("matching_pursuit", d_in=2, d_sae=2, apply_b_dec_to_input=False)
        >>> sae = wb.SAE.from_tensors(cfg, {"W_dec": torch.eye(2), "b_dec": torch.ones(2)})
        >>> sae.encode(torch.tensor([[2.0, -3.0]])).detach(), sae(torch.tensor([[2.0, -3.0]])).detach()
        (tensor([[2., 0.]]), tensor([[2., 0.]]))
        >>> wb.SAEConfig("matching_pursuit", d_in=2, d_sae=2, residual_threshold=-1.0)
        Traceback (most recent call last):
        workbench.errors.ConfigError: SAEConfig.residual_threshold must be a number from 0, got -1.0
    """

    activation = "matching_pursuit"
    weights = ()
    config_fields = ("residual_threshold", "max_iterations", "stop_on_duplicate_support")

    def encode(self, sae: nn.Module, x: Float[Tensor, "... i"], acts_pre: HookFn) -> Float[Tensor, "... X"]:
        cfg = sae.cfg
        return matching_pursuit(x, sae.W_dec, cfg.residual_threshold, cfg.max_iterations,
                                cfg.stop_on_duplicate_support)

    def activate(self, sae: nn.Module, hidden_pre: Float[Tensor, "... X"]) -> Float[Tensor, "... X"]:
        raise InputError(f"{sae!r}: a matching-pursuit SAE has no pre-activation to activate; use encode")

    def stores_encoder(self, cfg: Any) -> bool:
        return False

    def adds_b_dec(self, cfg: Any) -> bool:
        return cfg.apply_b_dec_to_input

    def check_config(self, cfg: Any) -> None:
        threshold = cfg.residual_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold) \
                or threshold < 0:
            raise ConfigError(f"SAEConfig.residual_threshold must be a number from 0, got {threshold!r}")
        steps = cfg.max_iterations
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError(f"SAEConfig.max_iterations must be an integer from 1 or null, got {steps!r}")
        if not isinstance(cfg.stop_on_duplicate_support, bool):
            raise ConfigError(f"SAEConfig.stop_on_duplicate_support must be true or false, got "
                              f"{cfg.stop_on_duplicate_support!r}")


SPECS = rows(MatchingPursuit(), "matching_pursuit")
TRAINING = ()  # inference only
