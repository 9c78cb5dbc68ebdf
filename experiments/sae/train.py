"""``train_sae``: SAEs (standard, top-k, batch-top-k, JumpReLU) and per-layer transcoders on any model we load.

Legend: B batch, P position, N flattened tokens, i d_in, o d_out.

The loop (``experiments.sae.loop``, the one ``train_saes`` and ``train_clt`` run too) is SAELens 6's ``SAETrainer``: Adam (betas 0.9 / 0.999), a constant learning rate with optional linear
warm-up and a linear decay to ``lr / 10`` over the last ``lr_decay_steps``, gradients clipped to norm 1, the
sparsity coefficient warmed up, and dead features tracked as SAELens does (a feature is dead when it has not
fired for ``dead_feature_window`` steps; top-k's aux-k loss trains them). Activations come from
``experiments.sae.activations`` (model or disk cache, a shuffling buffer bounding memory). Every
``log_every`` steps a row of the log (loss terms, L0, explained variance, dead fraction, lr) is kept;
every ``checkpoint_every`` steps ``checkpoint_dir/step-{n}/`` receives the full training state, from which
``resume_from`` continues to exactly the result of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import pandas as pd
import torch
from torch import Tensor

from experiments._progress import ProgressArg
from experiments.sae.activations import special_token_ids
from experiments.sae.checkpoints import run_identity
from experiments.sae.inputs import check_train_inputs, token_rows
from experiments.sae.loop import LOG_COLUMNS, Member, geometric_median, hook_columns, train_members
from experiments.sae.modules import TrainingSAE
from experiments.sae.parallel import current_world
from workbench.errors import InputError
from workbench.sae import SAE
LOG_FILE = "training_log.csv"  # checkpoints' files: experiments.sae.checkpoints
__all__ = ["TrainSAEConfig", "train_sae", "training_options", "saved_metadata", "run_training", "TrainingResult",
           "geometric_median", "LOG_COLUMNS", "LOG_FILE"]


@dataclass(frozen=True, kw_only=True)
class TrainSAEConfig:
    """Training hyper-parameters (SAELens's names and defaults where it has them).

    Example:
        >>> TrainSAEConfig(training_tokens=4096, train_batch_size_tokens=512).total_steps
        8
    """

    training_tokens: int = 2_000_000
    train_batch_size_tokens: int = 4096
    lr: float = 3e-4
    lr_warm_up_steps: int = 0
    lr_decay_steps: int = 0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    l1_coefficient: float = 1.0
    lp_norm: float = 1.0
    l1_warm_up_steps: int = 0
    l0_coefficient: float = 1.0
    l0_warm_up_steps: int = 0
    jumprelu_bandwidth: float = 0.05
    jumprelu_init_threshold: float = 0.01
    aux_loss_coefficient: float = 1.0
    topk_threshold_lr: float = 0.01
    matryoshka_widths: tuple[int, ...] = ()  # matryoshka_batchtopk's levels (d_sae is added as the last)
    use_matryoshka_aux_loss: bool = False  # matryoshka_batchtopk: one aux-k loss per level, on that level's residual
    decoder_init_norm: Optional[float] = 0.1
    b_dec_init: str = "mean"  # "mean", "geometric_median" or "zeros"
    dead_feature_window: int = 1000
    buffer_tokens: int = 65536  # rows the shuffling buffer holds (SAELens: n_batches_in_buffer * batch * context)
    store_batch_size_prompts: int = 8  # token rows per forward pass
    exclude_special_tokens: bool = True
    outlier_norm_ratio: Optional[float] = None  # leave out rows with norm > this x the chunk's median (massive acts)
    log_every: int = 10
    checkpoint_every: int = 0  # steps; 0: no checkpoints
    seed: int = 0

    @property
    def total_steps(self) -> int:
        """Optimizer steps: ``training_tokens // train_batch_size_tokens``."""
        return self.training_tokens // self.train_batch_size_tokens


def train_sae(model, hook_name: str, data: Any, architecture: str = "topk", d_sae: int = 4096, k: Optional[int] = 32,
              hook_name_out: Optional[str] = None, skip: bool = False, config: Optional[TrainSAEConfig] = None,
              activation_cache: Optional[Sequence[Union[str, Path]]] = None, out: Union[None, str, Path] = None,
              checkpoint_dir: Union[None, str, Path] = None, resume_from: Union[None, str, Path] = None,
              save_dtype: str = "float32", progress: ProgressArg = True, **overrides: Any) -> SAE:
    """Trains an SAE (or, with ``hook_name_out``, a per-layer transcoder) on ``model``'s ``hook_name`` activations.

    ``data``: token rows ``[B, P]``, or texts / a path (cut into 128-token windows by
    ``experiments.datasets.corpus_windows``). ``architecture``: ``standard`` (L1), ``topk``, ``batchtopk`` (saved as
    ``jumprelu``) or ``jumprelu``; ``k`` is the (average) number of active features for the top-k kinds.
    ``hook_name_out`` and ``skip``: a transcoder reading ``hook_name`` and predicting ``hook_name_out`` (with a
    linear skip ``W_skip``); saved as SAELens's ``transcoder`` / ``skip_transcoder`` / ``jumprelu_transcoder``.
    ``config``: a ``TrainSAEConfig``, its fields also accepted as keywords. ``activation_cache``: directories a
    ``model.run_with_cache(data, names_filter=..., cache_dir=...)`` wrote (read instead of running the model).
    ``out``: where the SAE (SAELens format, ``save_dtype``) and ``training_log.csv`` are written. The log is
    ``sae.training_log`` (a DataFrame). Bad input is an ``InputError`` naming the argument, before anything runs.

    Example:
        >>> tokens = torch.randint(1, 2048, (16, 32))
        >>> sae = train_sae(model, "blocks.0.hook_resid_post", tokens, "topk", d_sae=64, k=4, progress=False,
        ...                 training_tokens=2048, train_batch_size_tokens=256, buffer_tokens=512)
        >>> sae.cfg.architecture(), sae.cfg.hook_name, list(sae.training_log.columns[:3])
        ('topk', 'blocks.0.hook_resid_post', ['step', 'tokens', 'loss'])
    """
    cfg = dataclasses.replace(config or TrainSAEConfig(), **_config_overrides(overrides))
    tokens = token_rows(model, data)
    widths = check_train_inputs(model, hook_name, hook_name_out, architecture, d_sae, k, skip, cfg, tokens)
    transcoder = hook_name_out is not None
    # The initialisation and the data order draw from generators of their own, so SAEs of any size trained
    # together on one stream (experiments.sae.multi) see the batches each would see trained alone.
    sae = TrainingSAE(architecture, widths[0], d_sae, widths[1], skip=skip, transcoder=transcoder,
                      options=training_options(cfg, k), generator=torch.Generator().manual_seed(cfg.seed))
    result = run_training(model, sae, tokens, [hook_name], [hook_name_out] if transcoder else [], cfg,
                          torch.Generator().manual_seed(cfg.seed), activation_cache, checkpoint_dir, resume_from,
                          progress, desc=f"training {architecture} SAE")
    metadata = saved_metadata(model, cfg, tokens, hook_name, hook_name_out)
    trained = sae.to_sae(metadata, scale_in=result.scales[0][0], scale_out=result.scales[1][0], dtype=save_dtype)
    trained.training_log = result.log
    if out is not None and current_world().writes:  # data-parallel: rank 0 writes
        trained.save(out)
        result.log.to_csv(Path(out) / LOG_FILE, index=False)
    return trained


def training_options(cfg: TrainSAEConfig, k: Optional[float]) -> dict[str, Any]:
    """The architecture's coefficients a ``TrainingSAE`` takes, from ``cfg`` and ``k``.

    Example:
        >>> training_options(TrainSAEConfig(), 8)["k"], training_options(TrainSAEConfig(), 8)["l1_coefficient"]
        (8, 1.0)
    """
    options = {name: getattr(cfg, name) for name in ("l1_coefficient", "lp_norm", "l0_coefficient", "jumprelu_bandwidth",
                                                     "jumprelu_init_threshold", "aux_loss_coefficient",
                                                     "topk_threshold_lr", "decoder_init_norm",
                                                     "matryoshka_widths", "use_matryoshka_aux_loss")}
    options["k"] = k
    return options


def saved_metadata(model, cfg: TrainSAEConfig, tokens: Tensor, hook_name: str,
                   hook_name_out: Optional[str] = None) -> dict[str, Any]:
    """The SAELens metadata a trained SAE is saved with (hooks, model, context, special tokens left out).

    Example:
        >>> saved_metadata(model, TrainSAEConfig(), torch.zeros(2, 16, dtype=torch.long), "hook_embed")["context_size"]
        16
    """
    metadata = {"hook_name": hook_name, "model_name": getattr(model.cfg, "model_name", None),
                "context_size": int(tokens.shape[1]), "prepend_bos": bool(model.tokenizer is not None and model.bos_first()),
                "exclude_special_tokens": special_token_ids(model) if cfg.exclude_special_tokens else False,
                "outlier_norm_ratio": cfg.outlier_norm_ratio}
    if hook_name_out is not None:
        metadata["hook_name_out"] = hook_name_out
    return metadata


@dataclass
class TrainingResult:
    """What ``run_training`` leaves: the per-group input and target scales, and the log."""

    scales: tuple[list[float], list[float]]
    log: pd.DataFrame


def run_training(model, module, tokens: Tensor, input_hooks: list[str], target_hooks: list[str], cfg: TrainSAEConfig,
                 generator: torch.Generator, activation_cache, checkpoint_dir, resume_from, progress: ProgressArg,
                 scale_groups: int = 1, desc: str = "training") -> TrainingResult:
    """``module`` (a ``TrainingSAE`` or ``TrainingCLT``) trained alone by the one loop (``experiments.sae.loop``)
    on rows holding ``input_hooks``' activations (then ``target_hooks``', none: the inputs are the targets), each
    side scaled per group of ``scale_groups`` equal-width slices; what ``train_sae`` and ``train_clt`` run.

    Example:
        >>> from experiments.sae.modules import TrainingSAE
        >>> cfg = TrainSAEConfig(training_tokens=512, train_batch_size_tokens=128, buffer_tokens=256, log_every=4)
        >>> sae = TrainingSAE("standard", 128, 16, options=training_options(cfg, None))
        >>> result = run_training(model, sae, tokens.repeat(8, 1), ["blocks.0.hook_resid_post"], [], cfg,
        ...                       torch.Generator().manual_seed(0), None, None, None, progress=False)
        >>> len(result.scales[0]), list(result.log.step)
        (1, [4])
    """
    hooks = input_hooks + target_hooks
    columns = hook_columns(model, hooks, tokens)
    x_cols = slice(columns[input_hooks[0]].start, columns[input_hooks[-1]].stop)
    y_cols = slice(columns[target_hooks[0]].start, columns[target_hooks[-1]].stop) if target_hooks else None
    member = Member(module, cfg, (x_cols, y_cols), groups=scale_groups)
    run = run_identity(module, input_hooks, target_hooks, cfg, tokens)
    (log,) = train_members(model, [member], tokens, hooks, cfg, generator, run, module, activation_cache,
                           checkpoint_dir, resume_from, progress, desc=desc)
    return TrainingResult(scales=(list(member.scales[0]), list(member.scales[1])), log=log)


def _config_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(TrainSAEConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise InputError(f"train_sae got unknown argument(s) {unknown}; TrainSAEConfig fields are {sorted(known)}")
    return overrides
