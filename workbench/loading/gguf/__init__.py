"""GGUF files, read as the transformers checkpoint llama.cpp converted them from, so that each architecture's
HF family module (``workbench.loading.hf``) maps them exactly as it maps an HF directory.

- ``loader``: a GGUF file -> ``Decoder`` (``load_gguf``); ``GGUFFile``, ``GGUFCheckpoint`` (the file's tensors
  under transformers' names)
- ``architectures``: the table of llama.cpp architectures: metadata keys and ``Rule``s from GGUF tensor names
  to transformers'
- ``layouts``: the inverses of the converter's changes (Q/K permutation, 1 + w gains, transposes, Falcon's QKV
  order, stacked experts)
- ``tokenizer``: a ``tokenizers`` BPE built from the file's own vocabulary and merges
"""
