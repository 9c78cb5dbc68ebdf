"""Top-k (Gao et al. 2024; SAELens's ``TopKSAE`` / ``TopKTrainingSAE``): the ``k`` largest pre-activations of
each row fire, ReLU'd; with ``rescale_acts_by_decoder_norm`` they are chosen by pre-activation times decoder norm
and divided by it again before decoding (so the decoder's norm cannot drift the selection).

Legend: N flattened tokens, X d_sae, o d_out.

Training rescales (SAELens's default), decodes the ``k`` active columns only, and adds the aux-k loss: the top
``d_out // 2`` dead features (by pre-activation) reconstruct the detached residual ``y - y_hat`` as ``W_dec z``
(no ``b_dec``: SAELens 6.54, after the paper's appendix A.2, since the residual holds it already), scaled by
``min(n_dead / (d_out // 2), 1) * aux_loss_coefficient``. Saved as ``topk`` with ``k``; no transcoder format.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from jaxtyping import Float
from torch import Tensor, nn

from workbench.sae import activations
from workbench.sae.architectures.base import Encoding, SparseDecode, TrainingForm, rows


class TopK(Encoding):
    """The ``k`` largest pre-activations of each row (``cfg.k``), chosen after the decoder-norm rescaling if any.

    Example (decoder norms 1 and 4 make the second feature the larger):
        >>> from types import SimpleNamespace
        >>> sae = SimpleNamespace(cfg=SimpleNamespace(k=1, rescale_acts_by_decoder_norm=True),
        ...                       W_dec=torch.tensor([[1.0, 0.0], [0.0, 4.0]]))
        >>> TopK().activate(sae, torch.tensor([[3.0, 1.0]]))
        tensor([[0., 4.]])
    """

    activation = "topk"
    config_fields = ("k", "rescale_acts_by_decoder_norm")

    def activate(self, sae: nn.Module, hidden_pre: Float[Tensor, "... d_sae"]) -> Float[Tensor, "... d_sae"]:
        if sae.cfg.rescale_acts_by_decoder_norm:  # top-k chooses by pre-activation times decoder norm
            hidden_pre = hidden_pre * sae.W_dec.norm(dim=-1)
        return activations.topk(hidden_pre, sae.cfg.k)


class TopKTraining(TrainingForm):
    """Top-k with the decoder-norm rescaling, a sparse decode and the aux-k loss.

    Example (no feature dead: no aux-k loss; the k = 1 active feature of each row, ReLU'd):
        >>> form, pre = TopKTraining(), torch.tensor([[3.0, -1.0], [-2.0, -5.0]])
        >>> form.sparse_features(pre, {"k": 1})
        (tensor([[0],
                [0]]), tensor([[3.],
                [0.]]))
        >>> form.auxiliary_loss(pre, torch.zeros(2, 4), torch.zeros(2, dtype=torch.bool), None, {})
        {'aux_loss': tensor(0.)}
    """

    name = "topk"
    k_kind = "integer"
    saved_as = ("topk", None, None)
    rescales = True

    def activate(self, hidden_pre: Float[Tensor, "N X"], state: Mapping[str, Tensor],
                 options: Mapping[str, Any]) -> Float[Tensor, "N X"]:
        return activations.topk(hidden_pre, options["k"])

    def sparse_features(self, hidden_pre: Float[Tensor, "N X"], options: Mapping[str, Any],
                        ) -> Optional[tuple[Tensor, Tensor]]:
        top = hidden_pre.topk(options["k"], dim=-1, sorted=False)  # the same numbers as the dense decode
        return top.indices, top.values.relu()

    def auxiliary_loss(self, hidden_pre: Float[Tensor, "N X"], residual: Float[Tensor, "N o"], dead: Tensor,
                       decode_sparse: SparseDecode, options: Mapping[str, Any]) -> dict[str, Tensor]:
        return {"aux_loss": aux_k_loss(hidden_pre, residual, dead, decode_sparse,
                                       options.get("aux_loss_coefficient", 1.0))}

    def inference_config(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return {"k": int(options["k"]), "rescale_acts_by_decoder_norm": True}


def aux_k_loss(hidden_pre: Float[Tensor, "N X"], residual: Float[Tensor, "N o"], dead: Tensor,
               decode_sparse: SparseDecode, coefficient: float = 1.0) -> Tensor:
    """The aux-k term (SAELens's ``calculate_topk_aux_loss``): the top ``d_out // 2`` dead
    features of each row (by pre-activation) reconstruct the detached ``residual`` through ``decode_sparse``
    (feature indices, values), the squared error summed over the width and averaged over rows, scaled by
    ``min(n_dead / (d_out // 2), 1)`` and ``coefficient``; 0 when no feature is dead. Matryoshka's per-level
    aux loss calls it on each level's slice of the features.

    Example (d_out 2: the one dead feature, pre-activation 2, rebuilds a residual of (3, 3) through a decoder
    row of ones):
        >>> decode = lambda indices, values: values.sum(-1, keepdim=True).expand(-1, 2)
        >>> aux_k_loss(torch.tensor([[5.0, 2.0]]), torch.tensor([[3.0, 3.0]]), torch.tensor([False, True]), decode)
        tensor(2.)
    """
    n_dead, half = int(dead.sum()), residual.shape[-1] // 2
    if n_dead == 0:
        return hidden_pre.new_tensor(0.0)
    scale = min(n_dead / half, 1.0)
    masked = torch.where(dead[None], hidden_pre, torch.tensor(-torch.inf, dtype=hidden_pre.dtype))
    top = masked.topk(min(half, n_dead), sorted=False)
    recons = decode_sparse(top.indices, top.values)
    return coefficient * scale * (recons - residual.detach()).pow(2).sum(-1).mean()


SPECS = rows(TopK(), "topk")
TRAINING = (TopKTraining(),)
