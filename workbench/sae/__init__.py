"""Sparse autoencoders and transcoders in SAELens's format: ``SAEConfig``, ``SAE``, ``load_sae``.

- ``activations``: relu, JumpReLU (with SAELens's straight-through estimator), top-k, batch-top-k: the one copy
  inference and training (``experiments.sae``) share;
- ``architectures``: one module per architecture (standard, gated, jumprelu, topk, batchtopk), each holding its
  inference encode and its training form, and the table built from them (``ARCHITECTURES``);
- ``config``: ``SAEConfig`` / ``SAEMetadata`` and reading a ``cfg.json`` of SAELens 6 or earlier;
- ``math``: encode and decode, SAELens's arithmetic;
- ``tensors``: the one check of an SAE's tensors;
- ``model``: ``SAE``, the ``HookedRootModule`` with SAELens's weights and hook points;
- ``format``: the directory's files and ``save_sae``; ``files``: ``load_sae``;
- ``foreign``: SAEs in other libraries' layouts (SAELens's conversion kinds), converted at the file boundary;
- ``shipped``: the SAEs and transcoders shipped beside the zoo models (``shipped_saes``), loadable by name;
- ``splicing``: splicing SAEs into a model as hooks over its public hook surface (``model.run_with_saes`` and
  friends forward here through ``workbench.sae_splicing``).

Weights are SAELens's layout: ``W_enc [d_in, d_sae]``, ``W_dec [d_sae, d_out]``, ``W_skip [d_out, d_in]`` applied as
``x @ W_skip.T``; other layouts (circuit-tracer's) are converted by the file readers and writers only.
"""

from workbench.sae.architectures import ARCHITECTURES
from workbench.sae.config import SAEConfig, SAEMetadata
from workbench.sae.files import load_sae
from workbench.sae.format import save_sae
from workbench.sae.model import SAE
from workbench.sae.shipped import shipped_saes

__all__ = ["ARCHITECTURES", "SAEConfig", "SAEMetadata", "SAE", "load_sae", "save_sae", "shipped_saes"]
