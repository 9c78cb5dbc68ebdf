"""JumpReLU (Rajamanoharan et al. 2024; SAELens's ``JumpReLUSAE`` / ``JumpReLUTrainingSAE``): a feature fires
when its pre-activation passes a learned per-feature threshold, ``relu(pre) * (pre > threshold)``.

Legend: N flattened tokens, X d_sae.

Training keeps the log-threshold (``jumprelu_init_threshold`` at first); the threshold gets SAELens's
straight-through gradient (the rectangle kernel of ``jumprelu_bandwidth``: ``workbench.sae.activations``), and
the loss adds ``l0_coefficient * sum_f step(pre - threshold)`` (SAELens's L0 penalty, "step" mode), warmed up
over ``l0_warm_up_steps``. Saved with the threshold ``exp(log_threshold)``. Its transcoders are the same encode.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from jaxtyping import Float
from torch import Tensor, nn

from workbench.sae import activations
from workbench.sae.architectures.base import Encoding, TrainingForm, rows


class JumpReLU(Encoding):
    """``relu(pre) * (pre > threshold)``, with a stored ``threshold [d_sae]``.

    Example:
        >>> from types import SimpleNamespace
        >>> JumpReLU().activate(SimpleNamespace(threshold=torch.tensor([1.0, 1.0])), torch.tensor([0.5, 2.0]))
        tensor([0., 2.])
    """

    activation = "jumprelu"
    weights = ("b_enc", "threshold")

    def activate(self, sae: nn.Module, hidden_pre: Float[Tensor, "... d_sae"]) -> Float[Tensor, "... d_sae"]:
        return activations.jumprelu(hidden_pre, sae.threshold)


class JumpReLUTraining(TrainingForm):
    """JumpReLU with a trained log-threshold and the L0 penalty.

    Example (thresholds 1 and 4: the first feature fires, the second does not; the L0 of the row is 1):
        >>> form, state = JumpReLUTraining(), {"log_threshold": torch.tensor([1.0, 4.0]).log()}
        >>> pre = torch.tensor([[2.0, 3.0]])
        >>> form.activate(pre, state, {}), form.sparsity_loss(None, pre, state, None, {}, coefficient_scale=0.5)
        (tensor([[2., 0.]]), {'l0_loss': tensor(0.5000)})
    """

    name = "jumprelu"
    saved_as = ("jumprelu", "jumprelu_transcoder", "jumprelu_skip_transcoder")
    warm_up = "l0_warm_up_steps"

    def new_state(self, layers: tuple[int, ...], d_sae: int, options: Mapping[str, Any]) -> dict[str, Tensor]:
        init = options.get("jumprelu_init_threshold", 0.01)
        return {"log_threshold": nn.Parameter(torch.full((*layers, d_sae), float(torch.tensor(init).log())))}

    def activate(self, hidden_pre: Float[Tensor, "N X"], state: Mapping[str, Tensor],
                 options: Mapping[str, Any]) -> Float[Tensor, "N X"]:
        return activations.jumprelu(hidden_pre, state["log_threshold"].exp(), options.get("jumprelu_bandwidth", 0.05))

    def sparsity_loss(self, acts: Tensor, hidden_pre: Tensor, state: Mapping[str, Tensor], decoder_norms: Tensor,
                      options: Mapping[str, Any], coefficient_scale: float) -> dict[str, Tensor]:
        l0 = activations.step(hidden_pre.flatten(1), state["log_threshold"].exp().flatten(),
                              options.get("jumprelu_bandwidth", 0.05)).sum(-1)
        return {"l0_loss": (coefficient_scale * options.get("l0_coefficient", 1.0) * l0).mean()}

    def inference_tensors(self, state: Mapping[str, Tensor], d_sae: int) -> dict[str, Tensor]:
        return {"threshold": state["log_threshold"].detach().float().exp()}


SPECS = rows(JumpReLU(), "jumprelu", "jumprelu_transcoder", "jumprelu_skip_transcoder")
TRAINING = (JumpReLUTraining(),)
