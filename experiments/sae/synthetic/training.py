"""``train_sae_on_synthetic_data``: the SAE trainer (``experiments.sae.train_sae``, its loop, losses and checks)
run on synthetic activations instead of a model's.

``SyntheticActivationSource`` is the smallest stand-in for a model that ``train_sae`` reads activations from: one
hook point, ``hook_synthetic``, whose ``run_with_cache`` returns fresh samples ``[rows, positions, D]`` from the
generator and the feature dictionary (the token ids are placeholders that only set how many samples a chunk holds).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch import Tensor

from experiments.sae.synthetic.activation_generator import ActivationGenerator
from experiments.sae.synthetic.feature_dictionary import FeatureDictionary
from experiments.sae.modules import K_KIND
from experiments.sae.train import train_sae
from workbench.errors import InputError
from workbench.sae import SAE

HOOK_NAME = "hook_synthetic"
POSITIONS = 64  # samples per placeholder token row


class SyntheticActivationSource:
    """A "model" with one hook point whose activations are the synthetic hidden activations.

    Example:
        >>> source = SyntheticActivationSource(FeatureDictionary(4, 3, initializer=None, seed=0),
        ...                                    ActivationGenerator(4, 0.5))
        >>> source.run_with_cache(torch.zeros(2, 5, dtype=torch.long), names_filter=[HOOK_NAME])[1][HOOK_NAME].shape
        torch.Size([2, 5, 3])
    """

    tokenizer = None
    hook_dict = {HOOK_NAME: None}

    def __init__(self, feature_dict: FeatureDictionary, activations_generator: ActivationGenerator):
        if activations_generator.num_features != feature_dict.num_features:
            raise InputError(f"the generator has {activations_generator.num_features} features; the dictionary has "
                             f"{feature_dict.num_features}")
        self.feature_dict, self.generator = feature_dict, activations_generator
        self.cfg = SimpleNamespace(n_layers=1, d_vocab=1, device="cpu", model_name="synthetic")

    @torch.no_grad()
    def run_with_cache(self, tokens: Tensor, names_filter: Any = None, **_: Any) -> tuple[None, dict[str, Tensor]]:
        """``(None, {hook: [rows, positions, D]})``: ``rows * positions`` fresh samples."""
        rows, positions = tokens.shape
        hidden = self.feature_dict(self.generator.sample(rows * positions)).float()
        return None, {HOOK_NAME: hidden.reshape(rows, positions, -1)}


def train_sae_on_synthetic_data(feature_dict: FeatureDictionary, activations_generator: ActivationGenerator,
                                architecture: str = "topk", d_sae: Optional[int] = None, k: Optional[int] = None,
                                training_samples: int = 200_000, batch_size: int = 1024, seed: int = 0,
                                **config: Any) -> SAE:
    """A ``wb.SAE`` trained by ``train_sae`` on ``training_samples`` synthetic samples (``d_sae`` defaults to the
    number of true features, ``k`` to the rounded mean true L0). ``config``: further ``TrainSAEConfig`` fields.
    The global torch generator is seeded with ``seed`` for the run and restored afterwards.

    Example:
        >>> fd = FeatureDictionary(8, 8, seed=0)
        >>> sae = train_sae_on_synthetic_data(fd, ActivationGenerator(8, 0.2), k=2, training_samples=8192,
        ...                                   batch_size=512)
        >>> sae.cfg.architecture(), sae.cfg.d_sae, sae.cfg.hook_name
        ('topk', 8, 'hook_synthetic')
    """
    d_sae = feature_dict.num_features if d_sae is None else d_sae
    if k is None and K_KIND.get(architecture) is not None:
        k = max(1, round(float(activations_generator.firing_probabilities.sum())))
    source = SyntheticActivationSource(feature_dict, activations_generator)
    settings = {"training_tokens": training_samples, "train_batch_size_tokens": batch_size,
                "buffer_tokens": max(4 * batch_size, 8192), "store_batch_size_prompts": max(1, batch_size // POSITIONS),
                "exclude_special_tokens": False, "seed": seed, "lr": 3e-3, "dead_feature_window": 100, **config}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return train_sae(source, HOOK_NAME, torch.zeros(1, POSITIONS, dtype=torch.long), architecture, d_sae=d_sae,
                         k=k, progress=False, **settings)
