"""SAELens's batch-top-k and Matryoshka batch-top-k training checkpoints (``BatchTopKTrainingSAE`` /
``MatryoshkaBatchTopKTrainingSAE``'s ``save_model``: architecture ``batchtopk`` / ``matryoshka_batchtopk``, the
training config, ``W_enc``, ``b_enc``, ``W_dec``, ``b_dec`` and the scalar running ``topk_threshold``) read for
inference as SAELens's ``save_inference_model`` turns them into a JumpReLU SAE.

Legend: X d_sae.

A feature fires where its pre-activation, times its decoder norm when ``rescale_acts_by_decoder_norm`` (SAELens's
batch-top-k default), is above ``topk_threshold``, with that value; the decode divides by the decoder norms again.
That is the JumpReLU SAE SAELens saves (encoder times the norms, decoder divided by them, every feature's threshold
``topk_threshold``), without folding. The training config's other fields (``k``, ``matryoshka_widths``, the
coefficients) do not change inference and are not kept. SAELens's inference loader refuses these checkpoints (its
``SAE.load_from_disk`` knows no such architecture); its ``TrainingSAE.load_from_disk`` reads them.
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor, nn

from workbench.sae import activations
from workbench.sae.architectures.base import Encoding, rows


class BatchTopKThreshold(Encoding):
    """JumpReLU at the checkpoint's global ``topk_threshold``, after the decoder-norm rescaling if any.

    Example (decoder norms 1 and 4: the second feature's 0.5 becomes 2, above the threshold 1):
        >>> import torch
        >>> from types import SimpleNamespace
        >>> sae = SimpleNamespace(cfg=SimpleNamespace(rescale_acts_by_decoder_norm=True),
        ...                       W_dec=torch.tensor([[1.0, 0.0], [0.0, 4.0]]), topk_threshold=torch.tensor(1.0))
        >>> BatchTopKThreshold().activate(sae, torch.tensor([[0.9, 0.5]]))
        tensor([[0., 2.]])
    """

    activation = "batchtopk_threshold"
    scalars = ("topk_threshold",)
    config_fields = ("rescale_acts_by_decoder_norm",)

    def activate(self, sae: nn.Module, hidden_pre: Float[Tensor, "... X"]) -> Float[Tensor, "... X"]:
        if sae.cfg.rescale_acts_by_decoder_norm:  # the threshold is in units of pre-activation times decoder norm
            hidden_pre = hidden_pre * sae.W_dec.norm(dim=-1)
        return activations.jumprelu(hidden_pre, sae.topk_threshold.to(hidden_pre.dtype))


SPECS = rows(BatchTopKThreshold(), "batchtopk") + rows(BatchTopKThreshold(), "matryoshka_batchtopk")
TRAINING = ()  # the training forms are batchtopk.py's (and SAELens saves those as jumprelu)
