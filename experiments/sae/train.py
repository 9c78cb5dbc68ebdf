"""``train_sae``: SAEs (standard, top-k, batch-top-k, JumpReLU) and per-layer transcoders on any model we load.

Legend: B batch, P position, N flattened tokens, i d_in, o d_out.

The loop is SAELens 6's ``SAETrainer``: Adam (betas 0.9 / 0.999), a constant learning rate with optional linear
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
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.sae.activations import ShuffleBuffer, activation_chunks, special_token_ids
from experiments.sae.checkpoints import load_checkpoint, run_identity, save_checkpoint
from experiments.sae.inputs import check_train_config, check_train_inputs, hook_layer, token_rows
from experiments.sae.modules import TrainingSAE
from workbench.errors import InputError
from workbench.sae import SAE
LOG_FILE = "training_log.csv"  # checkpoints' files: experiments.sae.checkpoints
LOG_COLUMNS = ("step", "tokens", "loss", "mse_loss", "sparsity_loss", "l0", "explained_variance", "dead_fraction", "lr")


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
    if out is not None:
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
                                                     "topk_threshold_lr", "decoder_init_norm")}
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
    """The training loop shared by ``train_sae`` and ``train_clt``: ``module`` (a ``TrainingSAE`` or
    ``TrainingCLT``: ``training_forward``, ``b_dec``, ``n_features``, ``form``) trained on rows holding ``input_hooks``'
    activations (then ``target_hooks``', none: the inputs are the targets), each side scaled per group of
    ``scale_groups`` equal-width slices."""
    hooks = input_hooks + target_hooks
    optimizer = torch.optim.Adam(module.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2))
    exclude = special_token_ids(model) if cfg.exclude_special_tokens else []
    check_train_config(cfg, tokens, exclude)
    run = run_identity(module, input_hooks, target_hooks, cfg, tokens)
    state = None
    if resume_from is not None:  # checked whole, then loaded into the module and the optimizer
        state = load_checkpoint(resume_from, run, module, optimizer, cfg.total_steps, scale_groups,
                                chunk_rows=cfg.store_batch_size_prompts * tokens.shape[1])
    stop_at = max(hook_layer(model, h) for h in hooks) + 1
    chunks = activation_chunks(model, tokens, hooks, cfg.store_batch_size_prompts, stop_at, exclude,
                               start_row=state["buffer"]["rows_consumed"] if state else 0, cache_dirs=activation_cache,
                               outlier_norm_ratio=cfg.outlier_norm_ratio)
    buffer = ShuffleBuffer(chunks, cfg.buffer_tokens, cfg.train_batch_size_tokens, generator,
                           state=state["buffer"] if state else None)
    tracker = _Tracker(module.n_features)
    if state:
        tracker.load(state["tracker"])
        scales, step, log_rows = state["scales"], state["step"], state["log"]
    else:
        scales = _initialise(module, buffer, scale_groups, bool(target_hooks), cfg.b_dec_init)
        step, log_rows = 0, []
    n_in = buffer.peek(1).shape[1] // (2 if target_hooks else 1)
    warm = getattr(cfg, module.form.warm_up) if module.form.warm_up else 0  # the sparsity coefficient's warm-up
    with Progress(progress, total=cfg.total_steps, desc=desc) as bar:
        bar.advance(step)
        while step < cfg.total_steps:
            rows = buffer.next_batch()
            x = _scaled(rows[:, :n_in], scales[0])
            target = _scaled(rows[:, n_in:], scales[1]) if target_hooks else x
            lr = _lr(cfg, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            out = module.training_forward(x, target, tracker.dead(cfg.dead_feature_window),
                                          coefficient_scale=min(1.0, (step + 1) / warm) if warm else 1.0)
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            tracker.update(out["feature_acts"])
            step += 1
            bar.advance()
            if step % cfg.log_every == 0 or step == cfg.total_steps:
                log_rows.append(_log_row(step, cfg, out, target, tracker, lr))
            if checkpoint_dir is not None and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                save_checkpoint(Path(checkpoint_dir) / f"step-{step}", run, module, optimizer, buffer.state(),
                                tracker.steps_since_fired, scales, step, log_rows)
    return TrainingResult(scales=(list(scales[0]), list(scales[1])), log=pd.DataFrame(log_rows, columns=list(LOG_COLUMNS)))


def _scaled(rows: Tensor, scales: list[float]) -> Tensor:
    """``rows`` [N, G*W] with slice g multiplied by ``scales[g]``."""
    if len(scales) == 1:
        return rows * scales[0]
    return (rows.reshape(rows.shape[0], len(scales), -1) * torch.tensor(scales)[:, None]).flatten(1)


def _config_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(TrainSAEConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise InputError(f"train_sae got unknown argument(s) {unknown}; TrainSAEConfig fields are {sorted(known)}")
    return overrides


def _lr(cfg: TrainSAEConfig, step: int) -> float:
    """SAELens's "constant" schedule: linear warm-up to ``lr``, then constant, then a linear decay to ``lr / 10``
    over the last ``lr_decay_steps``."""
    if cfg.lr_warm_up_steps and step < cfg.lr_warm_up_steps:
        return cfg.lr * (step + 1) / cfg.lr_warm_up_steps
    decay_start = cfg.total_steps - cfg.lr_decay_steps
    if cfg.lr_decay_steps and step >= decay_start:
        return cfg.lr * (1 - 0.9 * (step - decay_start + 1) / cfg.lr_decay_steps)
    return cfg.lr


@torch.no_grad()
def _initialise(module, buffer: ShuffleBuffer, groups: int, has_targets: bool, b_dec_init: str) -> tuple[list, list]:
    """Per-group input / target scales (mean norm -> sqrt(width): SAELens's ``expected_average_only_in``) and
    ``b_dec`` (mean or geometric median of the scaled targets) from the first mixed rows, which stay in the buffer
    and are trained on as usual."""
    sample = buffer.peek(max(buffer.batch_rows, min(buffer.capacity // 2, 8192)))
    n_in = sample.shape[1] // (2 if has_targets else 1)
    x = sample[:, :n_in].reshape(len(sample), groups, -1)
    y = sample[:, n_in:].reshape(len(sample), groups, -1) if has_targets else x

    def scales_of(acts: Tensor) -> list[float]:
        return [math.sqrt(acts.shape[-1]) / float(acts[:, g].norm(dim=-1).mean().clamp_min(1e-12)) for g in range(groups)]

    scale_in = scales_of(x)
    scale_out = scales_of(y) if has_targets else scale_in
    y = y * torch.tensor(scale_out)[:, None]
    if b_dec_init == "mean":
        module.b_dec.copy_(y.mean(0).reshape(module.b_dec.shape))
    elif b_dec_init == "geometric_median":
        module.b_dec.copy_(geometric_median(y.flatten(1)).reshape(module.b_dec.shape))
    return scale_in, scale_out


def geometric_median(points: torch.Tensor, iterations: int = 100, eps: float = 1e-8) -> torch.Tensor:
    """Weiszfeld's algorithm: the point minimising the summed distances to ``points`` [N, D] (SAELens's
    ``compute_geometric_median``, which ``b_dec_init_method="geometric_median"`` used).

    Example (on the diagonal the distances to the first and last points add up to a constant, so the median is
    where the middle two are nearest, (0.5, 0.5); the mean would be (2.75, 2.75)):
        >>> geometric_median(torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [10.0, 10.0]])).round(decimals=2)
        tensor([0.5000, 0.5000])
    """
    median = points.mean(0)
    for _ in range(iterations):
        weights = 1 / (points - median).norm(dim=-1).clamp_min(eps)
        new = (weights[:, None] * points).sum(0) / weights.sum()
        if (new - median).norm() < eps * max(1.0, float(median.norm())):
            return new
        median = new
    return median


class _Tracker:
    """SAELens's dead-feature bookkeeping: steps since each feature last fired."""

    def __init__(self, d_sae: int):
        self.steps_since_fired = torch.zeros(d_sae)

    def dead(self, window: int) -> Tensor:
        return self.steps_since_fired > window

    def update(self, feature_acts: Tensor) -> None:
        self.steps_since_fired += 1
        self.steps_since_fired[(feature_acts > 0).any(0)] = 0

    def load(self, state: dict[str, Tensor]) -> None:
        self.steps_since_fired = state["steps_since_fired"].clone()


def _log_row(step: int, cfg: TrainSAEConfig, out: dict[str, Any], target: Tensor, tracker: _Tracker, lr: float) -> dict:
    """SAELens's training metrics: explained variance ``1 - mean ||y - y_hat||^2 / mean ||y - mean y||^2``, L0."""
    with torch.no_grad():
        residual = (target - out["sae_out"]).pow(2).sum(-1).mean()
        variance = (target - target.mean(0)).pow(2).sum(-1).mean()
        sparsity = sum(float(v) for name, v in out["losses"].items() if name != "mse_loss")
        return {"step": step, "tokens": step * cfg.train_batch_size_tokens, "loss": float(out["loss"]),
                "mse_loss": float(out["losses"]["mse_loss"]), "sparsity_loss": sparsity,
                "l0": float((out["feature_acts"] > 0).sum(-1).float().mean()),
                "explained_variance": float(1 - residual / variance),
                "dead_fraction": float(tracker.dead(cfg.dead_feature_window).float().mean()), "lr": lr}
