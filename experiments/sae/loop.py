"""The one SAE training loop: ``train_sae``, ``train_saes`` and ``train_clt`` all run ``train_members``.

Legend: N flattened tokens, i d_in.

(A buffered row holds every hook any member needs side by side; ``i`` below is that row's width.)

The loop is SAELens 6's ``SAETrainer``: Adam (betas 0.9 / 0.999), a constant learning rate with optional linear
warm-up and a linear decay to ``lr / 10`` over the last ``lr_decay_steps``, gradients clipped to norm 1, the
sparsity coefficient warmed up, and dead features tracked as SAELens does (a feature is dead when it has not
fired for ``dead_feature_window`` steps; top-k's aux-k loss trains them).

A run trains one or more ``Member``s (a ``TrainingSAE`` or ``TrainingCLT`` with its own settings) on one stream of
buffered rows: one model forward per chunk captures every hook any member needs, side by side in a row; each
member reads its own columns (input, then target), with its own scales (per group of ``groups`` equal-width
slices), ``b_dec`` initialisation, schedule, sparsity warm-up, clipping (norm 1 per member), dead-feature counters,
log and Adam parameter group (Adam's update of a parameter reads only that parameter's state, so members do not
interact, and a member trained with others ends exactly as it does alone). A checkpoint holds every member's
state (``state_module``), the shared buffer, the members' scales side by side, their counters and their logs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor, nn

from experiments._progress import Progress, ProgressArg
from experiments.sae.activations import ShuffleBuffer, activation_chunks, special_token_ids
from experiments.sae.checkpoints import load_checkpoint, save_checkpoint
from experiments._depth import stop_at_layer_for
from experiments.sae.inputs import check_train_config
from experiments.sae.parallel import World, check_parallel_forms, current_world

LOG_COLUMNS = ("step", "tokens", "loss", "mse_loss", "sparsity_loss", "l0", "explained_variance", "dead_fraction", "lr")


class Tracker:
    """SAELens's dead-feature bookkeeping: steps since each feature last fired.

    Example:
        >>> tracker = Tracker(3)
        >>> tracker.update(torch.tensor([[1.0, 0.0, 0.0]])); tracker.update(torch.tensor([[0.0, 0.0, 2.0]]))
        >>> tracker.steps_since_fired.tolist(), tracker.dead(1).tolist()
        ([1.0, 2.0, 0.0], [False, True, False])
    """

    def __init__(self, d_sae: int):
        self.steps_since_fired = torch.zeros(d_sae)

    def dead(self, window: int) -> Tensor:
        return self.steps_since_fired > window

    def update(self, feature_acts: Tensor) -> None:
        self.steps_since_fired += 1
        self.steps_since_fired[(feature_acts > 0).any(0)] = 0

    def load(self, state: dict[str, Tensor]) -> None:
        self.steps_since_fired = state["steps_since_fired"].clone()


@dataclass
class Member:
    """One module of a run: ``module`` (``training_forward``, ``b_dec``, ``n_features``, ``form``), its settings
    ``cfg`` (a ``TrainSAEConfig``), its columns of a buffered row (input, target; ``None``: the input is the
    target), its number of equal-width scale groups, and what the run sets: scales and tracker."""

    module: nn.Module
    cfg: Any
    columns: tuple[slice, Optional[slice]] = (slice(0), None)
    groups: int = 1
    scales: tuple[list[float], list[float]] = ([1.0], [1.0])
    tracker: Tracker = field(default=None)

    def __post_init__(self):
        if self.tracker is None:
            self.tracker = Tracker(self.module.n_features)


def hook_columns(model, hooks: list[str], tokens: Tensor) -> dict[str, slice]:
    """Each hook's columns in a buffered row (the hooks' widths side by side, in ``hooks``' order), from one
    two-token forward.

    Example:
        >>> hook_columns(model, ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"], tokens)
        {'blocks.0.hook_resid_post': slice(0, 128, None), 'blocks.1.hook_resid_post': slice(128, 256, None)}
    """
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[:1, :2].to(model.cfg.device), names_filter=list(hooks),
                                        stop_at_layer=stop_at_layer_for(model, hooks), return_type=None)
    columns, start = {}, 0
    for hook in hooks:
        columns[hook] = slice(start, start + int(cache[hook].shape[-1]))
        start = columns[hook].stop
    return columns


def train_members(model, members: list[Member], tokens: Tensor, hooks: list[str], cfg: Any, generator: torch.Generator,
                  run: dict[str, Any], state_module: nn.Module, activation_cache, checkpoint_dir, resume_from,
                  progress: ProgressArg, desc: str = "training", log_per_member: bool = False) -> list[pd.DataFrame]:
    """Trains ``members`` on rows of ``hooks``' activations (``cfg``: the shared stream's sizes; ``generator``: the
    buffer's order) and returns each member's log; each member's scales and tracker are set. ``run`` and
    ``state_module`` are what a checkpoint records and restores; ``log_per_member``: a checkpoint's log rows hold
    every member's row (``{"step", "saes"}``) rather than a lone member's.

    Example:
        >>> from experiments.sae.modules import TrainingSAE
        >>> from experiments.sae.train import TrainSAEConfig
        >>> cfg = TrainSAEConfig(training_tokens=512, train_batch_size_tokens=128, buffer_tokens=256, log_every=2)
        >>> sae = TrainingSAE("topk", 128, 32, options={"k": 4, "decoder_init_norm": 0.1})
        >>> member = Member(sae, cfg, (slice(0, 128), None))
        >>> logs = train_members(model, [member], tokens.repeat(8, 1), ["blocks.0.hook_resid_post"], cfg,
        ...                      torch.Generator().manual_seed(0), {}, sae, None, None, None, progress=False)
        >>> list(logs[0].step)
        [2, 4]
    """
    world = current_world()  # more than one process: data-parallel (experiments.sae.parallel)
    check_parallel_forms(world, [m.module for m in members])
    optimizer = torch.optim.Adam([{"params": list(m.module.parameters()), "lr": m.cfg.lr,
                                   "betas": (m.cfg.adam_beta1, m.cfg.adam_beta2)} for m in members])
    exclude = special_token_ids(model) if cfg.exclude_special_tokens else []
    check_train_config(cfg, tokens, exclude)
    state = None
    if resume_from is not None:  # checked whole, then loaded into the modules and the optimizer
        state = load_checkpoint(resume_from, run, state_module, optimizer, cfg.total_steps,
                                sum(m.groups for m in members), chunk_rows=cfg.store_batch_size_prompts * tokens.shape[1])
    chunks = activation_chunks(model, tokens, hooks, cfg.store_batch_size_prompts,
                               stop_at_layer_for(model, hooks), exclude,
                               start_row=state["buffer"]["rows_consumed"] if state else 0, cache_dirs=activation_cache,
                               outlier_norm_ratio=cfg.outlier_norm_ratio)
    buffer = ShuffleBuffer(chunks, cfg.buffer_tokens, cfg.train_batch_size_tokens, generator,
                           state=state["buffer"] if state else None)
    if state:
        _restore(members, state)
        step, log_rows = state["step"], state["log"]
    else:
        for member in members:
            member.scales = _initialise(member.module, _Columns(buffer, member), member.groups,
                                        member.columns[1] is not None, member.cfg.b_dec_init)
        step, log_rows = 0, []
    with Progress(progress, total=cfg.total_steps, desc=desc) as bar:
        bar.advance(step)
        while step < cfg.total_steps:
            rows = buffer.next_batch()
            mine = world.rows(rows)
            outs = [_forward(member, group, mine, step) for member, group in zip(members, optimizer.param_groups)]
            loss = sum(out["loss"] for out, _, _ in outs)  # disjoint parameters: each member its own gradient
            (loss if world.size == 1 else loss * world.share(len(rows))).backward()
            for member in members:
                world.sum_gradients(list(member.module.parameters()))
                torch.nn.utils.clip_grad_norm_(member.module.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            for member, (out, _, _) in zip(members, outs):
                member.tracker.update(world.fired(out["feature_acts"]))
            step += 1
            bar.advance()
            if step % cfg.log_every == 0 or step == cfg.total_steps:
                rows_now = [log_row(step, m.cfg, *_whole_batch(world, out, target, len(rows)), m.tracker, lr)
                            for m, (out, target, lr) in zip(members, outs)]
                log_rows.append({"step": step, "saes": rows_now} if log_per_member else rows_now[0])
            if checkpoint_dir is not None and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                scales = ([s for m in members for s in m.scales[0]], [s for m in members for s in m.scales[1]])
                fired = torch.cat([m.tracker.steps_since_fired for m in members])
                if world.writes:
                    save_checkpoint(Path(checkpoint_dir) / f"step-{step}", run, state_module, optimizer,
                                    buffer.state(), fired, scales, step, log_rows)
                world.barrier()
    per_member = [[row["saes"][i] for row in log_rows] if log_per_member else log_rows for i in range(len(members))]
    return [pd.DataFrame(rows, columns=list(LOG_COLUMNS)) for rows in per_member]


def _whole_batch(world: World, out: dict[str, Any], target: Tensor, n_rows: int) -> tuple[dict[str, Any], Tensor]:
    """A member's step output and target over the whole batch (every process's rows), for its log row."""
    if world.size == 1:
        return out, target
    share = world.share(n_rows)
    whole = {"loss": torch.tensor(world.total(out["loss"] * share)),
             "losses": {name: torch.tensor(world.total(value * share)) for name, value in out["losses"].items()},
             "feature_acts": world.gather(out["feature_acts"]), "sae_out": world.gather(out["sae_out"])}
    return whole, world.gather(target)


def _restore(members: list[Member], state: dict[str, Any]) -> None:
    """Each member's scales and dead-feature counters from a checked checkpoint (side by side there)."""
    counters = state["tracker"]["steps_since_fired"].split([m.module.n_features for m in members])
    start = 0
    for member, fired in zip(members, counters):
        member.scales = tuple(list(side[start:start + member.groups]) for side in state["scales"])
        member.tracker.steps_since_fired = fired.clone()
        start += member.groups


class _Columns:
    """A view of the shared buffer holding one member's columns (input, then target): what ``_initialise`` peeks."""

    def __init__(self, buffer: ShuffleBuffer, member: Member):
        self.buffer, self.member = buffer, member
        self.batch_rows, self.capacity = buffer.batch_rows, buffer.capacity

    def peek(self, n_rows: int) -> Float[Tensor, "n_rows i"]:
        rows = self.buffer.peek(n_rows)
        x_cols, y_cols = self.member.columns  # contiguous, as the rows a lone member's buffer holds
        return rows[:, x_cols].contiguous() if y_cols is None else torch.cat([rows[:, x_cols], rows[:, y_cols]], -1)


def _forward(member: Member, group: dict[str, Any], rows: Float[Tensor, "N i"], step: int) -> tuple[dict, Tensor, float]:
    """One member's training forward on its columns of ``rows`` (its lr set on its parameter group): (out, target, lr)."""
    x_cols, y_cols = member.columns
    x = scaled(rows[:, x_cols], member.scales[0])
    target = scaled(rows[:, y_cols], member.scales[1]) if y_cols is not None else x
    lr = group["lr"] = learning_rate(member.cfg, step)
    warm = getattr(member.cfg, member.module.form.warm_up) if member.module.form.warm_up else 0
    out = member.module.training_forward(x, target, member.tracker.dead(member.cfg.dead_feature_window),
                                         coefficient_scale=min(1.0, (step + 1) / warm) if warm else 1.0)
    return out, target, lr


def scaled(rows: Float[Tensor, "N i"], scales: list[float]) -> Float[Tensor, "N i"]:
    """``rows`` [N, G*W] with slice g multiplied by ``scales[g]``.

    Example:
        >>> scaled(torch.ones(1, 4), [2.0, 3.0])
        tensor([[2., 2., 3., 3.]])
    """
    if len(scales) == 1:
        return rows * scales[0]
    return (rows.reshape(rows.shape[0], len(scales), -1) * torch.tensor(scales)[:, None]).flatten(1)


def learning_rate(cfg: Any, step: int) -> float:
    """SAELens's "constant" schedule: linear warm-up to ``lr``, then constant, then a linear decay to ``lr / 10``
    over the last ``lr_decay_steps``.

    Example:
        >>> from experiments.sae.train import TrainSAEConfig
        >>> cfg = TrainSAEConfig(training_tokens=40, train_batch_size_tokens=4, lr=1.0, lr_decay_steps=5)
        >>> learning_rate(cfg, 0), round(learning_rate(cfg, 9), 6)
        (1.0, 0.1)
    """
    if cfg.lr_warm_up_steps and step < cfg.lr_warm_up_steps:
        return cfg.lr * (step + 1) / cfg.lr_warm_up_steps
    decay_start = cfg.total_steps - cfg.lr_decay_steps
    if cfg.lr_decay_steps and step >= decay_start:
        return cfg.lr * (1 - 0.9 * (step - decay_start + 1) / cfg.lr_decay_steps)
    return cfg.lr


@torch.no_grad()
def _initialise(module, buffer, groups: int, has_targets: bool, b_dec_init: str) -> tuple[list, list]:
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


def log_row(step: int, cfg: Any, out: dict[str, Any], target: Tensor, tracker: Tracker, lr: float) -> dict:
    """SAELens's training metrics: explained variance ``1 - mean ||y - y_hat||^2 / mean ||y - mean y||^2``, L0.

    Example:
        >>> from experiments.sae.train import TrainSAEConfig
        >>> out = {"sae_out": torch.zeros(2, 2), "loss": torch.tensor(1.0), "losses": {"mse_loss": torch.tensor(1.0)},
        ...        "feature_acts": torch.tensor([[1.0, 0.0], [1.0, 1.0]])}
        >>> row = log_row(1, TrainSAEConfig(), out, torch.tensor([[1.0, 0.0], [-1.0, 0.0]]), Tracker(2), 0.1)
        >>> row["l0"], row["explained_variance"]
        (1.5, 0.0)
    """
    with torch.no_grad():
        residual = (target - out["sae_out"]).pow(2).sum(-1).mean()
        variance = (target - target.mean(0)).pow(2).sum(-1).mean()
        sparsity = sum(float(v) for name, v in out["losses"].items() if name != "mse_loss")
        return {"step": step, "tokens": step * cfg.train_batch_size_tokens, "loss": float(out["loss"]),
                "mse_loss": float(out["losses"]["mse_loss"]), "sparsity_loss": sparsity,
                "l0": float((out["feature_acts"] > 0).sum(-1).float().mean()),
                "explained_variance": float(1 - residual / variance),
                "dead_fraction": float(tracker.dead(cfg.dead_feature_window).float().mean()), "lr": lr}
