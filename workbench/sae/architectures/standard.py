"""Standard: ReLU features, trained with an L1 penalty on the activations times the decoder norms (SAELens's
``StandardSAE`` / ``StandardTrainingSAE``); its transcoder and skip transcoder are the same encode.

Legend: N flattened tokens, X d_sae.

Training: ``l1_coefficient * ||f * ||W_dec||_row||_p`` (``lp_norm``; over every feature axis of a cross-layer
transcoder, its decoder norms over all the layers it writes), warmed up linearly over ``l1_warm_up_steps``.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxtyping import Float
from torch import Tensor, nn

from workbench.sae import activations
from workbench.sae.architectures.base import Encoding, TrainingForm, rows


class ReLU(Encoding):
    """``max(x W_enc + b_enc, 0)``.

    Example:
        >>> ReLU().activate(None, torch.tensor([-1.0, 2.0]))
        tensor([0., 2.])
    """

    activation = "relu"

    def activate(self, sae: nn.Module, hidden_pre: Float[Tensor, "... d_sae"]) -> Float[Tensor, "... d_sae"]:
        return activations.relu(hidden_pre)


class StandardTraining(TrainingForm):
    """ReLU with the L1 penalty scaled by the decoder norms.

    Example (one row, features 1 and 3 with decoder norms 2 and 0.5: 2 * (1 * 2 + 3 * 0.5) = 7):
        >>> StandardTraining().sparsity_loss(torch.tensor([[1.0, 3.0]]), None, {}, torch.tensor([2.0, 0.5]),
        ...                                  {"l1_coefficient": 2.0}, coefficient_scale=1.0)
        {'l1_loss': tensor(7.)}
    """

    name = "standard"
    saved_as = ("standard", "transcoder", "skip_transcoder")
    warm_up = "l1_warm_up_steps"

    def activate(self, hidden_pre: Float[Tensor, "N X"], state: Mapping[str, Tensor],
                 options: Mapping[str, Any]) -> Float[Tensor, "N X"]:
        return activations.relu(hidden_pre)

    def sparsity_loss(self, acts: Tensor, hidden_pre: Tensor, state: Mapping[str, Tensor], decoder_norms: Tensor,
                      options: Mapping[str, Any], coefficient_scale: float) -> dict[str, Tensor]:
        weighted = acts * decoder_norms
        sparsity = weighted.flatten(1).norm(p=options.get("lp_norm", 1.0), dim=-1)
        return {"l1_loss": (coefficient_scale * options.get("l1_coefficient", 1.0) * sparsity).mean()}


SPECS = rows(ReLU(), "standard", "transcoder", "skip_transcoder")
TRAINING = (StandardTraining(),)
