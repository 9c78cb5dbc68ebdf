"""Ground truth for SAEs, like SAELens's SynthSAEBench: synthetic activations with known features, and the metrics
that score an SAE against them (SAELens 6.54's ``sae_lens.synthetic``, the same names).

- ``feature_dictionary``: ``FeatureDictionary`` (true feature directions; more features than dimensions is
  superposition) and its orthogonalizing initializer;
- ``activation_generator``: ``ActivationGenerator`` (firing probabilities, magnitudes, correlations, modifiers);
- ``firing``: Zipfian / linear / random firing probabilities and magnitude configs;
- ``correlation``: full and low-rank feature correlations;
- ``evals``: ``eval_sae_on_synthetic_data`` (true and SAE L0, dead latents, shrinkage, explained variance, MCC after
  Hungarian matching, uniqueness, per-latent precision / recall / F1) and ``perfect_sae``;
- ``matching``: ``linear_sum_assignment`` (the Hungarian method; scipy is not a dependency);
"""

from experiments.sae.synthetic.activation_generator import ActivationGenerator
from experiments.sae.synthetic.correlation import (LowRankCorrelationMatrix,
                                                   create_correlation_matrix_from_correlations,
                                                   generate_random_correlation_matrix,
                                                   generate_random_low_rank_correlation_matrix)
from experiments.sae.synthetic.evals import (ClassificationMetrics, SyntheticDataEvalResult,
                                             eval_sae_on_synthetic_data, feature_uniqueness,
                                             mean_correlation_coefficient, perfect_sae)
from experiments.sae.synthetic.feature_dictionary import (FeatureDictionary, orthogonal_initializer,
                                                          orthogonalize_embeddings)
from experiments.sae.synthetic.firing import (linear_firing_probabilities, random_firing_probabilities,
                                              zipfian_firing_probabilities)

__all__ = ["ActivationGenerator", "ClassificationMetrics", "FeatureDictionary", "LowRankCorrelationMatrix",
           "SyntheticDataEvalResult", "create_correlation_matrix_from_correlations", "eval_sae_on_synthetic_data",
           "feature_uniqueness", "generate_random_correlation_matrix", "generate_random_low_rank_correlation_matrix",
           "linear_firing_probabilities", "mean_correlation_coefficient", "orthogonal_initializer",
           "orthogonalize_embeddings", "perfect_sae", "random_firing_probabilities", "zipfian_firing_probabilities"]
