"""SAE features: what a feature of a sparse autoencoder reads and writes, on a prompt and over a corpus.

Legend: B batch, P position, D d_model, V d_vocab, N flattened tokens, X d_sae, W windows kept per feature,
Z density histogram bins.

- ``activations``: feature activations on a prompt (``feature_activations`` [B, P, X], ``feature_on_prompt``)
  and the features active at each token (``active_features``), read from ``hook_sae_acts_post`` with the SAE
  spliced in with its error term (``model.saes(...)``), so nothing else in the model changes.
- ``corpus``: ``feature_corpus_stats``, one scan of the corpus-window engine (``experiments.corpus_windows``,
  the Neurons page's windows, ``experiments.neurons.neuron_corpus``) over ``n_windows`` windows of ``corpus`` (English prose or Python source; by default the model's own) for every feature
  at once (``sae_source``), ``batch_size`` windows at a time: a running top-``k`` of each feature's per-window
  maxima (where in which window) and a histogram of the log10 of its positive activations (fixed bins
  ``bin_edges()``; outside values in the end bins), the reducer ``TopWindowsAndDensity``. Memory is bounded by
  W x X plus one batch, whatever the corpus. BOS is left out (an outlier, not evidence). Kept in the engine's one
  disk cache under ``cache_directory()/features``, keyed by the model's and the SAE's weights and config, the
  window ids, k, the bins and the engine's version; written atomically, and read back only when the key and every
  tensor are what the pass writes (else recomputed and replaced).
- ``effects``: a feature's residual direction and direct logit effect (``feature_logit_effect``), its decoder
  row through the final norm's linear part and ``W_U``, as a neuron's (``experiments.neurons``).
- ``steering``: ``steering_hook`` (add ``alpha * W_dec[f]`` where the SAE writes), ``clamp_hook`` /
  ``ablation_hook`` (set ``hook_sae_acts_post[..., f]`` with the SAE spliced in), and
  ``continue_with_feature`` (a clean and an edited generation side by side).
- ``sources``: ``shipped_saes`` and ``shipped_choices`` (the SAEs and transcoder sets shipped for a model, rows of
  ``wb.shipped``) and ``open_sae``.

Figures: ``experiments.plots.features``.
"""

from experiments.features.activations import (acts_hook_name, active_features, check_feature, check_fits,
                                              feature_activations, feature_on_prompt)
from experiments.features.corpus import (FeatureStats, TopWindowsAndDensity, bin_edges, feature_corpus_stats,
                                         feature_density, feature_top_windows, sae_digest, sae_source, stats_path)
from experiments.features.effects import feature_logit_effect, residual_direction
from experiments.features.sources import open_sae, shipped_choices, shipped_saes
from experiments.features.steering import (FeatureEdit, ablation_hook, clamp_hook, continue_with_feature,
                                           steering_hook)

__all__ = ["check_feature", "check_fits", "acts_hook_name", "feature_activations", "feature_on_prompt",
           "active_features", "FeatureStats", "TopWindowsAndDensity", "sae_source", "bin_edges", "sae_digest", "stats_path", "feature_corpus_stats",
           "feature_top_windows", "feature_density", "residual_direction", "feature_logit_effect",
           "steering_hook", "clamp_hook", "ablation_hook", "FeatureEdit", "continue_with_feature",
           "shipped_saes", "shipped_choices", "open_sae"]
