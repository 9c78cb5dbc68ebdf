"""Gated (Rajamanoharan et al. 2024; SAELens's ``GatedSAE``): a gate path decides which features fire, a magnitude
path with the gate's encoder rescaled by ``exp(r_mag)`` decides how much.

``f = (x W_enc + b_gate > 0) * relu(x (W_enc * exp(r_mag)) + b_mag)``; ``hook_sae_acts_pre`` carries the magnitude
path. Gated SAEs are read and run; training one (SAELens's ``GatedTrainingSAE``) is not written yet: it would be a
``TrainingForm`` here and a line in ``TRAINING``.
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor, nn

from workbench.errors import InputError
from workbench.sae import activations
from workbench.sae.architectures.base import Encoding, HookFn, rows


class Gated(Encoding):
    """The gate and magnitude paths; no ``b_enc`` (``b_gate``, ``b_mag`` and ``r_mag`` instead).

    Example (the gate opens for the first feature only; its magnitude is 2 * e^0 - 1):
        >>> from types import SimpleNamespace
        >>> sae = SimpleNamespace(W_enc=torch.eye(2), b_gate=torch.tensor([0.0, -5.0]), r_mag=torch.zeros(2),
        ...                       b_mag=torch.tensor([-1.0, 0.0]))
        >>> Gated().encode(sae, torch.tensor([2.0, 3.0]), acts_pre=lambda pre: pre)
        tensor([1., 0.])
    """

    activation = "gated"
    weights = ("b_gate", "b_mag", "r_mag")

    def encode(self, sae: nn.Module, x: Float[Tensor, "... d_in"], acts_pre: HookFn) -> Float[Tensor, "... d_sae"]:
        active = (x @ sae.W_enc + sae.b_gate > 0).to(x.dtype)
        magnitude = acts_pre(x @ (sae.W_enc * sae.r_mag.exp()) + sae.b_mag)
        return active * activations.relu(magnitude)

    def activate(self, sae: nn.Module, hidden_pre: Float[Tensor, "... d_sae"]) -> Float[Tensor, "... d_sae"]:
        raise InputError(f"{sae!r}: a gated SAE's activation needs its input; use encode")


SPECS = rows(Gated(), "gated")
TRAINING = ()
