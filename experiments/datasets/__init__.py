"""Datasets the experiments run on: IOI prompts, repeated random tokens, corpus windows, and the
references that mean and resample ablation replace activations with.

Legend: B batch, P position.

- ``ioi_dataset``: indirect-object-identification prompts in the style of Wang et al. 2022
  ("When Mary and John went to the store, John gave a drink to" -> " Mary"), each with a
  corrupted twin of the same token length, padded into one batch with its attention mask.
- ``repeated_random_tokens``: a prefix token then ``seq_len`` random tokens twice (induction).
- ``corpus_windows``: fixed-length token windows cut from text files or a list of texts.
- ``english_documents``: English prose from Debian packages (the shipped SmolLM2 SAE's training text).
- ``mean_activations``: the mean activation at each position over a batch of prompts, computed
  one batch at a time so the whole dataset's cache is never held.
- ``resample_reference``: a seeded draw of rows of a batch, for resample ablation.

Modules: ``ioi``, ``random_tokens``, ``corpus``, ``english``, ``labelled`` (labelled offline text for probing:
languages, code against prose, handbook chapters; ``experiments.datasets.labelled``) and ``references`` (``mean_activations``,
``resample_reference``); every public name is importable from here.
"""

from experiments.datasets.corpus import corpus_windows
from experiments.datasets.english import english_documents
from experiments.datasets.ioi import (DEFAULT_NAMES, IOI_CORRUPTIONS, IOI_ORDERS, IOI_TEMPLATES, IOIDataset,
                                      ioi_dataset)
from experiments.datasets.random_tokens import prefix_token, repeated_random_tokens
from experiments.datasets.references import mean_activations, resample_reference

__all__ = ["IOIDataset", "ioi_dataset", "IOI_TEMPLATES", "DEFAULT_NAMES", "IOI_ORDERS", "IOI_CORRUPTIONS",
           "repeated_random_tokens", "prefix_token", "corpus_windows", "english_documents", "mean_activations", "resample_reference"]
