"""Ground truth for SAEs, like SAELens's SynthSAEBench: synthetic activations with known features, and the metrics
that score an SAE against them (SAELens 6.54's ``sae_lens.synthetic``, the same names).

- ``feature_dictionary``: ``FeatureDictionary`` (true feature directions; more features than dimensions is
  superposition) and its orthogonalizing initializer;
- ``activation_generator``: ``ActivationGenerator`` (firing probabilities, magnitudes, correlations, modifiers);
- ``firing``: Zipfian / linear / random firing probabilities and magnitude configs;
- ``correlation``: full and low-rank feature correlations;
- ``hierarchy``: ``HierarchyNode`` trees, ``generate_hierarchy`` and ``hierarchy_modifier`` (children fire only
  with their parent; mutually exclusive siblings);
- ``synthetic_model``: ``SyntheticModel`` (all of the above from one config) and SAELens's saved synthetic models
  (``SyntheticModel.load_from_disk``: SynthSAEBench-16k's folder layout, JSON and safetensors only);
- ``training``: ``train_sae_on_synthetic_data`` (``experiments.sae.train_sae`` on generated activations);
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
from experiments.sae.synthetic.hierarchy import (Hierarchy, HierarchyConfig, HierarchyNode, generate_hierarchy,
                                                 hierarchy_modifier)
from experiments.sae.synthetic.synthetic_model import SyntheticModel, SyntheticModelConfig
from experiments.sae.synthetic.training import train_sae_on_synthetic_data

__all__ = ["ActivationGenerator", "ClassificationMetrics", "FeatureDictionary", "Hierarchy", "HierarchyConfig",
           "HierarchyNode", "LowRankCorrelationMatrix", "SyntheticDataEvalResult", "SyntheticModel",
           "SyntheticModelConfig", "create_correlation_matrix_from_correlations", "eval_sae_on_synthetic_data",
           "feature_uniqueness", "generate_hierarchy", "generate_random_correlation_matrix",
           "generate_random_low_rank_correlation_matrix", "hierarchy_modifier", "linear_firing_probabilities",
           "mean_correlation_coefficient", "orthogonal_initializer", "orthogonalize_embeddings", "perfect_sae",
           "random_firing_probabilities", "train_sae_on_synthetic_data", "zipfian_firing_probabilities"]
