"""Steering vectors: contrastive activation addition (CAA), ActAdd and representation-engineering reading vectors
(PCA, repeng's method), read from and added to the residual stream after chosen blocks.

Names follow steering-vectors 0.12 so its users' code reads the same: ``train_steering_vector(model, pairs,
layers=None, read_token_index=-1, method="caa" | "actadd" | "pca")`` returns a ``SteeringVector`` whose
``layer_activations`` maps a block index to the direction added to that block's output
(``blocks.{l}.hook_resid_post``, steering-vectors' ``decoder_block`` and repeng's layer numbering).

- ``vector``: ``SteeringVector`` (``hooks``, ``apply`` as a context manager, ``save`` / ``load``)
- ``training``: ``train_steering_vector`` and the readers of contrast activations
- ``control_gguf``: llama.cpp control vectors as repeng 0.4 writes them (``export_gguf`` / ``import_gguf``)
- ``continuation``: ``continue_with_vector``, clean and steered continuations side by side
- ``sweep``: a coefficient sweep against a behaviour measure (``logit_difference``, ``token_probability``,
  ``direction_score``); ``plot.sweep_figure`` draws it
- ``files``: the vector on disk, safetensors + JSON
"""

from experiments.steering.continuation import continue_with_vector
from experiments.steering.sweep import coefficient_sweep, direction_score, logit_difference, token_probability
from experiments.steering.training import METHODS, read_contrast_activations, train_steering_vector
from experiments.steering.vector import SteeringVector

__all__ = ["SteeringVector", "train_steering_vector", "continue_with_vector", "read_contrast_activations", "METHODS",
           "coefficient_sweep", "logit_difference", "token_probability", "direction_score"]
