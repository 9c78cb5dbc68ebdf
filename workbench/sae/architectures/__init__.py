"""The architectures a sparse dictionary can have: one module each, holding its inference encode and its training
form side by side (SAELens's layout, ``saes/<name>_sae.py`` pairing ``XSAE`` with ``XTrainingSAE``), and the table
built from them.

- ``base``: ``ArchitectureSpec`` (a row: name, encoding, transcoder, skip; the tensors it stores), the ``Encoding``
  and ``TrainingForm`` bases, the encoder's affine map;
- ``standard``: ReLU (and the ReLU transcoder and skip transcoder), trained with the decoder-norm-scaled L1;
- ``gated``: the gate and magnitude paths (read and run; not trained yet);
- ``jumprelu``: JumpReLU (and its transcoders), trained with the log-threshold, straight-through estimator, L0;
- ``topk``: top-k with the decoder-norm rescaling, trained with the aux-k loss;
- ``batchtopk``: batch-top-k, a training form only (saved as ``jumprelu``, as SAELens saves it);
- ``matryoshka``: Matryoshka batch-top-k, batch-top-k with nested prefix reconstruction losses (a training form
  only, saved as ``jumprelu``);
- ``temporal``: attention layers predict codes from the earlier positions, a sparse code holds the novel rest
  (inference only; its attention layers are submodules, ``Encoding.submodules``);
- ``abstopk``: top-k by magnitude, keeping the sign (inference only);
- ``matching_pursuit``: greedy codes over a tied decoder (inference only);
- ``batchtopk_checkpoint``: SAELens's batch-top-k and Matryoshka training checkpoints, read for inference.

Every architecture SAELens 6 saves for inference is a row of ``ARCHITECTURES``; what differs between them is
the encoding (activation, the tensors it stores), whether it is a transcoder and whether it has ``W_skip``
(transcoder and skip variants are flags of a row, not modules). ``TRAINING_FORMS`` holds the forms
``experiments.sae`` trains. The generic parts look the architecture up here and never ask for its name: ``wb.SAE``
and ``workbench.sae.math`` (hook points, normalisation, decode), ``workbench.sae.tensors`` (file checks),
``experiments.sae`` (the training module and loop).

A new architecture (Matryoshka, abs-top-k, ...) is one new file here, defining an ``Encoding`` subclass
and its rows (``SPECS``, via ``base.rows``; empty if it is saved as another architecture) and a ``TrainingForm``
subclass (``TRAINING``; empty if it is not trained), plus one line in ``_MODULES`` below.
"""

from __future__ import annotations

from workbench.errors import ConfigError, InputError
from workbench.sae.architectures import (abstopk, batchtopk, batchtopk_checkpoint, gated, jumprelu, matching_pursuit,
                                        matryoshka, standard, temporal, topk)
from workbench.sae.architectures.base import Activation, ArchitectureSpec, Encoding, TrainingForm

# The registry: one line per architecture module.
_MODULES = (
    standard,
    gated,
    jumprelu,
    topk,
    batchtopk,
    matryoshka,
    temporal,
    abstopk,
    matching_pursuit,
    batchtopk_checkpoint,
)

# SAEs first, then transcoders (a stable sort keeps each group in the modules' order).
ARCHITECTURES: dict[str, ArchitectureSpec] = {
    spec.name: spec for spec in sorted((spec for module in _MODULES for spec in module.SPECS),
                                       key=lambda spec: spec.transcoder)}
TRAINING_FORMS: dict[str, TrainingForm] = {form.name: form for module in _MODULES for form in module.TRAINING}


def architecture_spec(name: object) -> ArchitectureSpec:
    """The row of ``ARCHITECTURES`` named ``name``; a ``ConfigError`` naming the field otherwise.

    Example:
        >>> architecture_spec("topk").activation
        'topk'
        >>> architecture_spec("matryoshka")
        Traceback (most recent call last):
        workbench.errors.ConfigError: SAE config field 'architecture' must be one of ('standard', 'gated', 'jumprelu', 'topk', 'temporal', 'abstopk', 'matching_pursuit', 'batchtopk', 'matryoshka_batchtopk', 'transcoder', 'skip_transcoder', 'jumprelu_transcoder', 'jumprelu_skip_transcoder'), got 'matryoshka'
    """
    spec = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ConfigError(f"SAE config field 'architecture' must be one of {tuple(ARCHITECTURES)}, got {name!r}")
    return spec


def training_form(name: object) -> TrainingForm:
    """The training form named ``name`` (``TRAINING_FORMS``); an ``InputError`` naming ``architecture`` otherwise.

    Example:
        >>> training_form("batchtopk").saved_name(transcoder=False, skip=False)
        'jumprelu'
        >>> training_form("gated")
        Traceback (most recent call last):
        workbench.errors.InputError: architecture must be one of ('standard', 'jumprelu', 'topk', 'batchtopk', 'matryoshka_batchtopk'), got 'gated'
    """
    form = TRAINING_FORMS.get(name) if isinstance(name, str) else None
    if form is None:
        raise InputError(f"architecture must be one of {tuple(TRAINING_FORMS)}, got {name!r}")
    return form


__all__ = ["ARCHITECTURES", "TRAINING_FORMS", "Activation", "ArchitectureSpec", "Encoding", "TrainingForm",
           "architecture_spec", "training_form"]
