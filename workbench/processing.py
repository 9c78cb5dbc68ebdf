"""TransformerLens's weight processing for a ``Decoder`` (being written: see the issue)."""

from __future__ import annotations


def process_weights(model, fold_ln: bool = True, center_writing_weights: bool = True, center_unembed: bool = True,
                    fold_value_biases: bool = True):
    raise NotImplementedError
