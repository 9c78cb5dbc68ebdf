"""Training and evaluating sparse autoencoders and transcoders on any model we load.

- ``train``: ``train_sae`` (standard, top-k, batch-top-k, JumpReLU SAEs; per-layer transcoders, with or
  without skip) and ``TrainSAEConfig``;
- ``clt``: ``train_clt``, cross-layer transcoders saved as a ``wb.TranscoderSet``;
- ``multi``: ``train_saes`` (several SAEs and transcoders, each on its own hook, from one forward pass per batch)
  and ``train_transcoders`` (a per-layer ``wb.TranscoderSet`` trained that way);
- ``evaluate``: ``evaluate_sae`` (L0, explained variance, CE loss recovered, dead and dense fractions);
- ``bench``: SAEBench 0.6's core measures with their spread over seeds, cached on disk (``core_metrics``,
  ``run_bench``, ``differs``; ``experiments.sae.bench``);
- ``modules``: the SAE under training (SAELens 6's definitions) and its inference form;
- ``activations``: activations streamed from the model or a disk cache, and the shuffling buffer;
- ``checkpoints``: training checkpoints, saved atomically and checked against the resuming run;
- ``inputs``: argument checks;
- ``loop``: the one training loop every trainer runs (``train_members``);
- ``parallel``: data-parallel training over ``torch.distributed`` (rank 0 writes).
- ``synthetic``: ground truth like SAELens's SynthSAEBench (``FeatureDictionary``, ``ActivationGenerator``,
  ``eval_sae_on_synthetic_data``, SAELens's saved synthetic models; ``experiments.sae.synthetic``).

``python -m experiments.sae cache|train|evaluate|bench`` is the command line (``experiments.cli.sae``).
"""

from experiments.sae.evaluate import evaluate_sae
from experiments.sae.clt import train_clt
from experiments.sae.train import TrainSAEConfig, train_sae
from experiments.sae.multi import SAESpec, train_saes, train_transcoders

__all__ = ["train_sae", "TrainSAEConfig", "evaluate_sae", "train_clt", "train_saes", "train_transcoders", "SAESpec"]
