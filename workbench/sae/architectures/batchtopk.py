"""Batch-top-k (Bussmann et al. 2024; SAELens's ``BatchTopKTrainingSAE``): a training form only. The ``k * N``
largest ReLU'd pre-activations of the whole batch fire (``k`` per row on average); a global threshold follows
the smallest that fired (an EMA at ``topk_threshold_lr``, kept in double precision as SAELens keeps it) and
becomes the per-feature threshold of the saved SAE, which is a ``jumprelu`` (as SAELens saves it), so this module
adds no row to the table.

Legend: N flattened tokens, X d_sae.

The rest is top-k's training form (the decoder-norm rescaling, the aux-k loss), with a dense decode.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from jaxtyping import Float
from torch import Tensor

from workbench.sae import activations
from workbench.sae.architectures.topk import TopKTraining


class BatchTopKTraining(TopKTraining):
    """Batch-top-k with its running threshold, saved as JumpReLU.

    Example (the threshold moves 1% of the way to the smallest activation that fired, 2):
        >>> form, state = BatchTopKTraining(), {"topk_threshold": torch.tensor(0.0, dtype=torch.float64)}
        >>> form.after_batch(torch.tensor([[0.0, 2.0], [3.0, 0.0]]), state, {"topk_threshold_lr": 0.01})
        >>> state["topk_threshold"].item(), form.inference_tensors(state, d_sae=2)
        (0.02, {'threshold': tensor([0.0200, 0.0200])})
    """

    name = "batchtopk"
    k_kind = "mean"
    couples_rows = True
    saved_as = ("jumprelu", "jumprelu_transcoder", "jumprelu_skip_transcoder")

    def new_state(self, layers: tuple[int, ...], d_sae: int, options: Mapping[str, Any]) -> dict[str, Tensor]:
        # double precision, as SAELens keeps it (the EMA of small minima loses bits in float32)
        return {"topk_threshold": torch.zeros(layers, dtype=torch.float64)}

    def activate(self, hidden_pre: Float[Tensor, "N X"], state: Mapping[str, Tensor],
                 options: Mapping[str, Any]) -> Float[Tensor, "N X"]:
        return activations.batch_topk(hidden_pre, options["k"])

    def sparse_features(self, hidden_pre: Float[Tensor, "N X"], options: Mapping[str, Any],
                        ) -> Optional[tuple[Tensor, Tensor]]:
        return None

    @torch.no_grad()
    def after_batch(self, acts: Float[Tensor, "N X"], state: Mapping[str, Tensor], options: Mapping[str, Any]) -> None:
        positive = acts[acts > 0]
        if positive.numel():
            lr = options.get("topk_threshold_lr", 0.01)
            state["topk_threshold"].mul_(1 - lr).add_(lr * positive.min().double())

    def inference_tensors(self, state: Mapping[str, Tensor], d_sae: int) -> dict[str, Tensor]:
        return {"threshold": torch.full((d_sae,), float(state["topk_threshold"]))}

    def inference_config(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return {}


SPECS = ()
TRAINING = (BatchTopKTraining(),)
