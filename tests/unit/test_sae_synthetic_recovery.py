"""Every trained architecture recovers planted features from synthetic data (``experiments.sae.synthetic``,
SynthSAEBench-like: 16 features in 16 dimensions, Zipf firing from 0.2 down to 0.05, magnitudes 1 +- 0.1), over
three training seeds, each above the MCC bound stated for it (``eval_sae_on_synthetic_data``'s Hungarian-matched
MCC on 4,096 fresh samples, 40,000 training samples at batch 512).

The bounds sit a little below the lowest of the three seeds measured when this test was written (topk 0.84,
batchtopk 0.70, matryoshka_batchtopk 0.71, standard 0.64, jumprelu 0.53); jumprelu's L0 penalty leaves it
about 11-14 active features against the true ~3 at this length, hence its low bound.
"""

from __future__ import annotations

import pytest
import torch

from experiments.sae.synthetic import (ActivationGenerator, FeatureDictionary, eval_sae_on_synthetic_data,
                                       zipfian_firing_probabilities)
from experiments.sae.synthetic.training import train_sae_on_synthetic_data

SEEDS = (0, 1, 2)
# architecture -> (train_sae_on_synthetic_data's settings, the MCC bound every seed must exceed)
CASES = {
    "topk": (dict(k=3, lr=1e-2), 0.80),
    "batchtopk": (dict(k=3, lr=1e-2), 0.65),
    "matryoshka_batchtopk": (dict(k=3, lr=1e-2, matryoshka_widths=(8, 16)), 0.65),
    "standard": (dict(lr=1e-2, l1_coefficient=3.0), 0.58),
    "jumprelu": (dict(lr=1e-2, l0_coefficient=10.0, jumprelu_init_threshold=0.1), 0.48),
}


@pytest.mark.parametrize("architecture", list(CASES))
def test_each_architecture_recovers_planted_features_over_three_seeds(architecture):
    settings, bound = CASES[architecture]
    scores = []
    for seed in SEEDS:
        fd = FeatureDictionary(16, 16, seed=0)
        gen = ActivationGenerator(16, zipfian_firing_probabilities(16, exponent=0.5, max_prob=0.2, min_prob=0.05),
                                  std_firing_magnitudes=0.1)
        sae = train_sae_on_synthetic_data(fd, gen, architecture, training_samples=40_000, batch_size=512, seed=seed,
                                          **settings)
        torch.manual_seed(0)
        scores.append(eval_sae_on_synthetic_data(sae, fd, gen, num_samples=4096).mcc)
    assert min(scores) > bound, (architecture, scores)
