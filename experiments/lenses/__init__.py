"""Lenses that read the residual stream as a prediction: the tuned lens and the Jacobian lens, beside the logit lens
(``experiments.lens``, whose names stay there).

``TunedLens`` (``translators``): per-layer affine translators, tuned-lens 0.2's files (``tuned_lens_files``; its
config, ``TunedLensConfig``, in ``config``; a shipped lens found by ``shipped``),
trained by ``train_tuned_lens`` (the loop in ``training``, checkpoints in ``checkpoints``; also ``TunedLens.train``);
``lens_kl_by_layer`` (``evaluation``) measures KL and cross-entropy by layer against the logit lens (its figure: ``experiments.plots.lenses.lens_kl_figure``; the command: ``python -m experiments.lenses``).
``JacobianLens`` (``jacobian``): TransformerLens 4.3's Jacobian lens, same names, also on a ``wb.load_model`` model
(imported on first use: it loads TransformerLens's analysis tools).
"""

from experiments.lenses.evaluation import lens_kl_by_layer
from experiments.lenses.translators import TunedLens, TunedLensConfig, lens_from_checkpoint, train_tuned_lens

__all__ = ["JacobianLens", "TunedLens", "TunedLensConfig", "lens_from_checkpoint", "lens_kl_by_layer",
           "train_tuned_lens"]


def __getattr__(name: str):
    if name == "JacobianLens":
        from experiments.lenses.jacobian import JacobianLens

        return JacobianLens
    raise AttributeError(f"module 'experiments.lenses' has no attribute {name!r}")
