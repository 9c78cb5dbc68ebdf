"""``train_saes``: several SAEs and transcoders from one forward pass per batch (SAELens's ``MultiSAETrainingRunner``
in spirit); ``train_transcoders``: a per-layer ``wb.TranscoderSet`` trained that way.

Legend: N flattened tokens, i d_in.

(A buffered row holds every hook any SAE needs side by side; ``i`` below is that row's width.)

One model forward per chunk captures every hook the specs name (each once, in the order first named); the rows go
through one shuffling buffer, so every SAE sees the same rows in the same order. Each SAE then trains on its own
columns of each batch, with its own scales, ``b_dec`` initialisation, learning-rate schedule, sparsity warm-up,
gradient clipping (norm 1 per SAE), dead-feature counters and log, and its own Adam moments (one Adam, a
parameter group per SAE: Adam's update of a parameter reads only that parameter's state, so the SAEs do not
interact). ``train_sae`` draws its initialisation and its data order from generators of their own seeded with
``seed``, so each SAE here ends exactly as ``train_sae`` would train it alone on the same data, seed and settings
(with ``outlier_norm_ratio`` set, a row that is an outlier at any hook is left out for every SAE).

The pieces are ``train_sae``'s (``experiments.sae.train``: schedule, initialisation, logging, dead-feature
tracker; ``activations``: chunks and buffer; ``checkpoints``): a checkpoint here holds every SAE's state (as one
``nn.ModuleList``), the shared buffer and each SAE's scales and log rows, and is refused by a run of other specs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor, nn

from experiments._progress import Progress, ProgressArg
from experiments.sae.activations import ShuffleBuffer, activation_chunks, special_token_ids
from experiments.sae.checkpoints import load_checkpoint, run_identity, save_checkpoint
from experiments.sae.clt import INPUT_HOOK, OUTPUT_HOOK
from experiments.sae.inputs import check_hook, check_train_config, check_train_inputs, hook_layer, token_rows
from experiments.sae.modules import TrainingSAE
from experiments.sae.train import (LOG_COLUMNS, LOG_FILE, TrainSAEConfig, _config_overrides, _initialise, _log_row,
                                   _lr, _scaled, _Tracker, saved_metadata, training_options)
from workbench.errors import InputError
from workbench.sae import SAE
from workbench.transcoders import TranscoderSet

# TrainSAEConfig fields one SAE may set for itself (the rest describe the shared data stream).
PER_SAE_FIELDS = ("lr", "lr_warm_up_steps", "lr_decay_steps", "adam_beta1", "adam_beta2", "l1_coefficient", "lp_norm",
                  "l1_warm_up_steps", "l0_coefficient", "l0_warm_up_steps", "jumprelu_bandwidth",
                  "jumprelu_init_threshold", "aux_loss_coefficient", "topk_threshold_lr", "decoder_init_norm",
                  "b_dec_init", "dead_feature_window")


@dataclass(frozen=True)
class SAESpec:
    """One SAE of a ``train_saes`` run: ``train_sae``'s arguments, ``name`` (its folder under ``out``; by default
    ``{hook_name}-{architecture}-{d_sae}``) and ``config``, its own values of ``PER_SAE_FIELDS`` (learning rate,
    coefficients, warm-ups).

    Example:
        >>> SAESpec("blocks.0.hook_resid_post", "jumprelu", d_sae=64).label
        'blocks.0.hook_resid_post-jumprelu-64'
    """

    hook_name: str
    architecture: str = "topk"
    d_sae: int = 4096
    k: Optional[float] = 32
    hook_name_out: Optional[str] = None
    skip: bool = False
    name: Optional[str] = None
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``name``, or ``{hook_name}-{architecture}-{d_sae}``."""
        return self.name if self.name is not None else f"{self.hook_name}-{self.architecture}-{self.d_sae}"


def train_saes(model, specs: Union[Sequence[Union[SAESpec, Mapping[str, Any]]], Mapping[str, Any]], data: Any,
               config: Optional[TrainSAEConfig] = None,
               activation_cache: Optional[Sequence[Union[str, Path]]] = None, out: Union[None, str, Path] = None,
               checkpoint_dir: Union[None, str, Path] = None, resume_from: Union[None, str, Path] = None,
               save_dtype: str = "float32", progress: ProgressArg = True, **overrides: Any) -> list[SAE]:
    """Trains the SAEs (and transcoders) ``specs`` describe together, one model forward per batch; each ends as
    ``train_sae`` would train it alone on ``data`` with the same ``config``.

    ``specs``: ``SAESpec``s or dicts of its fields, or a mapping name -> spec (SAELens's ``saes``). ``config`` (its
    fields also as keywords), ``activation_cache``, ``checkpoint_dir``, ``resume_from``, ``save_dtype``: as
    ``train_sae``'s, shared by all. Returns the ``wb.SAE``s in the specs' order, each with ``training_log``;
    ``out``: each saved to ``out/<name>`` (SAELens format, with its ``training_log.csv``). Bad specs (a duplicate
    name, a hook the model lacks, ``k`` above ``d_sae``, an unknown field) are an ``InputError`` before anything runs.

    Example:
        >>> saes = train_saes(model, [{"hook_name": "blocks.0.hook_resid_post", "d_sae": 64, "k": 4},
        ...                           {"hook_name": "blocks.1.hook_resid_post", "architecture": "standard", "d_sae": 32}],
        ...                   torch.randint(1, 2048, (16, 32)), progress=False, training_tokens=1024,
        ...                   train_batch_size_tokens=256, buffer_tokens=512)
        >>> [(sae.cfg.hook_name, sae.cfg.d_sae) for sae in saes], len(saes[0].training_log)
        ([('blocks.0.hook_resid_post', 64), ('blocks.1.hook_resid_post', 32)], 1)
    """
    cfg = dataclasses.replace(config or TrainSAEConfig(), **_config_overrides(overrides))
    tokens = token_rows(model, data)
    specs = _checked_specs(specs)
    hooks: list[str] = []
    for spec in specs:
        hooks += [h for h in (spec.hook_name, spec.hook_name_out) if h is not None and h not in hooks]
    members = [_member(model, spec, cfg, tokens) for spec in specs]
    columns = _hook_columns(model, hooks, tokens)
    for member in members:
        member.columns = (columns[member.spec.hook_name], columns.get(member.spec.hook_name_out))
    ensemble = nn.ModuleList([member.sae for member in members])
    ensemble.architecture = "+".join(f"{m.spec.label}:{m.spec.architecture}" for m in members)  # what a resume checks
    ensemble.options = {"k": [m.spec.k for m in members]}
    ensemble.n_features = sum(m.sae.n_features for m in members)
    optimizer = torch.optim.Adam([{"params": list(m.sae.parameters()), "lr": m.cfg.lr,
                                   "betas": (m.cfg.adam_beta1, m.cfg.adam_beta2)} for m in members])
    logs = _train_together(model, ensemble, members, optimizer, tokens, hooks, cfg, activation_cache, checkpoint_dir,
                           resume_from, progress)
    trained = []
    for member, log in zip(members, logs):
        sae = member.sae.to_sae(saved_metadata(model, cfg, tokens, member.spec.hook_name, member.spec.hook_name_out),
                                scale_in=member.scales[0], scale_out=member.scales[1], dtype=save_dtype)
        sae.training_log = log
        if out is not None:
            sae.save(Path(out) / member.spec.label)
            log.to_csv(Path(out) / member.spec.label / LOG_FILE, index=False)
        trained.append(sae)
    return trained


def train_transcoders(model, data: Any, d_transcoder: int = 4096, architecture: str = "standard",
                      k: Optional[float] = None, skip: bool = False, config: Optional[TrainSAEConfig] = None,
                      out: Union[None, str, Path] = None, progress: ProgressArg = True,
                      **kwargs: Any) -> TranscoderSet:
    """Per-layer transcoders for every layer of ``model`` (MLP input ``blocks.{l}.ln2.hook_normalized`` ->
    ``blocks.{l}.hook_mlp_out``, as ``train_clt`` reads and writes), trained together by ``train_saes`` from one
    forward pass per batch; a ``wb.TranscoderSet`` (``out``: saved as its ``save`` writes, which
    ``wb.load_transcoders`` reads; the layers' logs as ``out/training_log_{l}.csv``). ``kwargs``: ``train_saes``'s.

    Example:
        >>> mlp_model = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=50, n_ctx=16))
        >>> tc = train_transcoders(mlp_model, torch.randint(1, 50, (8, 16)), d_transcoder=16, progress=False,
        ...                        training_tokens=256, train_batch_size_tokens=64, buffer_tokens=128)
        >>> tc.cross_layer, tc.n_layers, tc.d_transcoder, tc.input_hook(1)
        (False, 2, 16, 'blocks.1.ln2.hook_normalized')
    """
    specs = [SAESpec(f"blocks.{layer}.{INPUT_HOOK}", architecture, d_transcoder, k,
                     hook_name_out=f"blocks.{layer}.{OUTPUT_HOOK}", skip=skip, name=f"layer_{layer}")
             for layer in range(model.cfg.n_layers)]
    for spec in specs:
        check_hook(model, spec.hook_name, "model (a transcoder set needs every layer's MLP: " + spec.hook_name + ")")
    layers = train_saes(model, specs, data, config, progress=progress, **kwargs)
    tc = TranscoderSet(feature_input_hook=INPUT_HOOK, feature_output_hook=OUTPUT_HOOK, layers=layers,
                       scan=getattr(model.cfg, "model_name", None))
    tc.training_logs = [layer.training_log for layer in layers]
    if out is not None:
        tc.save(out)
        for layer, log in enumerate(tc.training_logs):
            log.to_csv(Path(out) / f"training_log_{layer}.csv", index=False)
    return tc


# ---- the specs -------------------------------------------------------------------------------------------------
def _checked_specs(specs: Any) -> list[SAESpec]:
    if isinstance(specs, Mapping):
        specs = [dict(_as_fields(spec, f"specs[{name!r}]"), name=name) for name, spec in specs.items()]
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence) or not specs:
        raise InputError(f"specs must be a non-empty list of SAESpec (or dicts of its fields), got {type(specs).__name__}")
    checked = [SAESpec(**_as_fields(spec, f"specs[{i}]")) for i, spec in enumerate(specs)]
    names = [spec.label for spec in checked]
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
            raise InputError(f"specs[{i}].name must be a folder name (no '/', not '.' or '..'), got {name!r}")
        if names.index(name) != i:
            raise InputError(f"specs[{i}] has the name {name!r} of specs[{names.index(name)}]; give each a distinct name")
    return checked


def _as_fields(spec: Any, where: str) -> dict[str, Any]:
    if isinstance(spec, SAESpec):
        return dataclasses.asdict(spec)
    if not isinstance(spec, Mapping):
        raise InputError(f"{where} must be an SAESpec or a dict of its fields, got {type(spec).__name__}")
    known = [f.name for f in dataclasses.fields(SAESpec)]
    unknown = sorted(set(spec) - set(known))
    if unknown or "hook_name" not in spec:
        raise InputError(f"{where}: unknown field(s) {unknown} or no hook_name; SAESpec's fields are {known}")
    return dict(spec)


@dataclass
class _Member:
    """One SAE of the run: its spec, settings, module, buffer columns (input, target), scales and tracker."""

    spec: SAESpec
    cfg: TrainSAEConfig
    sae: TrainingSAE
    columns: tuple[slice, Optional[slice]]
    scales: tuple[float, float] = (1.0, 1.0)
    tracker: Any = None


def _member(model, spec: SAESpec, cfg: TrainSAEConfig, tokens: Tensor) -> _Member:
    """The spec checked (``train_sae``'s checks, with its own settings) and its SAE initialised as ``train_sae``
    initialises it; its columns are set once every spec is checked."""
    where = f"SAE {spec.label!r}"
    config = spec.config if isinstance(spec.config, Mapping) else None
    if config is None or set(config) - set(PER_SAE_FIELDS):
        raise InputError(f"{where}: config may set only {PER_SAE_FIELDS}, got "
                         f"{sorted(set(config) - set(PER_SAE_FIELDS)) if config is not None else spec.config!r}")
    own = dataclasses.replace(cfg, **config)
    try:
        d_in, d_out = check_train_inputs(model, spec.hook_name, spec.hook_name_out, spec.architecture, spec.d_sae,
                                         spec.k, spec.skip, own, tokens)
    except InputError as error:
        raise InputError(f"{where}: {error}") from None
    sae = TrainingSAE(spec.architecture, d_in, spec.d_sae, d_out, skip=spec.skip,
                      transcoder=spec.hook_name_out is not None, options=training_options(own, spec.k),
                      generator=torch.Generator().manual_seed(cfg.seed))
    return _Member(spec, own, sae, (slice(0), None), tracker=_Tracker(spec.d_sae))


def _hook_columns(model, hooks: list[str], tokens: Tensor) -> dict[str, slice]:
    """Each hook's columns in a buffered row (the hooks' widths side by side, in ``hooks``' order), from one
    two-token forward."""
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[:1, :2].to(model.cfg.device), names_filter=list(hooks),
                                        stop_at_layer=max(hook_layer(model, h) for h in hooks) + 1, return_type=None)
    columns, start = {}, 0
    for hook in hooks:
        columns[hook] = slice(start, start + int(cache[hook].shape[-1]))
        start = columns[hook].stop
    return columns


# ---- the loop ----------------------------------------------------------------------------------------------------
class _Columns:
    """A view of the shared buffer holding one SAE's columns (input, then target): what ``_initialise`` peeks."""

    def __init__(self, buffer: ShuffleBuffer, member: _Member):
        self.buffer, self.member = buffer, member
        self.batch_rows, self.capacity = buffer.batch_rows, buffer.capacity

    def peek(self, n_rows: int) -> Float[Tensor, "n_rows i"]:
        return _sides(self.buffer.peek(n_rows), self.member)


def _sides(rows: Float[Tensor, "N i"], member: _Member) -> Tensor:
    x_cols, y_cols = member.columns  # contiguous, as the rows a lone SAE's buffer holds
    return rows[:, x_cols].contiguous() if y_cols is None else torch.cat([rows[:, x_cols], rows[:, y_cols]], dim=-1)


def _train_together(model, ensemble: nn.ModuleList, members: list[_Member], optimizer: torch.optim.Optimizer,
                    tokens: Tensor, hooks: list[str], cfg: TrainSAEConfig, activation_cache, checkpoint_dir,
                    resume_from, progress: ProgressArg) -> list[pd.DataFrame]:
    """``run_training``'s loop for several SAEs on one stream; each member's scales and tracker are set here and
    each SAE's log is returned."""
    exclude = special_token_ids(model) if cfg.exclude_special_tokens else []
    check_train_config(cfg, tokens, exclude)
    run = run_identity(ensemble, hooks, [], cfg, tokens)
    state = None
    if resume_from is not None:
        state = load_checkpoint(resume_from, run, ensemble, optimizer, cfg.total_steps, len(members),
                                chunk_rows=cfg.store_batch_size_prompts * tokens.shape[1])
    chunks = activation_chunks(model, tokens, hooks, cfg.store_batch_size_prompts,
                               max(hook_layer(model, h) for h in hooks) + 1, exclude,
                               start_row=state["buffer"]["rows_consumed"] if state else 0, cache_dirs=activation_cache,
                               outlier_norm_ratio=cfg.outlier_norm_ratio)
    buffer = ShuffleBuffer(chunks, cfg.buffer_tokens, cfg.train_batch_size_tokens,
                           torch.Generator().manual_seed(cfg.seed), state=state["buffer"] if state else None)
    if state:
        counters = state["tracker"]["steps_since_fired"].split([m.sae.n_features for m in members])
        for i, member in enumerate(members):
            member.scales = (state["scales"][0][i], state["scales"][1][i])
            member.tracker.steps_since_fired = counters[i].clone()
        step, log_rows = state["step"], state["log"]
    else:
        for member in members:
            scale_in, scale_out = _initialise(member.sae, _Columns(buffer, member), 1, member.columns[1] is not None,
                                              member.cfg.b_dec_init)
            member.scales = (scale_in[0], scale_out[0])
        step, log_rows = 0, []
    with Progress(progress, total=cfg.total_steps, desc=f"training {len(members)} SAEs") as bar:
        bar.advance(step)
        while step < cfg.total_steps:
            rows = buffer.next_batch()
            outs = [_forward(member, group, rows, step) for member, group in zip(members, optimizer.param_groups)]
            sum(out["loss"] for out, _, _ in outs).backward()  # disjoint parameters: each SAE gets its own gradient
            for member in members:
                torch.nn.utils.clip_grad_norm_(member.sae.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            for member, (out, _, _) in zip(members, outs):
                member.tracker.update(out["feature_acts"])
            step += 1
            bar.advance()
            if step % cfg.log_every == 0 or step == cfg.total_steps:
                log_rows.append({"step": step, "saes": [_log_row(step, m.cfg, out, target, m.tracker, lr)
                                                        for m, (out, target, lr) in zip(members, outs)]})
            if checkpoint_dir is not None and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                scales = ([m.scales[0] for m in members], [m.scales[1] for m in members])
                fired = torch.cat([m.tracker.steps_since_fired for m in members])
                save_checkpoint(Path(checkpoint_dir) / f"step-{step}", run, ensemble, optimizer, buffer.state(), fired,
                                scales, step, log_rows)
    return [pd.DataFrame([row["saes"][i] for row in log_rows], columns=list(LOG_COLUMNS)) for i in range(len(members))]


def _forward(member: _Member, group: dict[str, Any], rows: Float[Tensor, "N i"], step: int) -> tuple[dict, Tensor, float]:
    """One SAE's training forward on its columns of ``rows`` (its lr set on its parameter group): (out, target, lr)."""
    x_cols, y_cols = member.columns
    x = _scaled(rows[:, x_cols], [member.scales[0]])
    target = _scaled(rows[:, y_cols], [member.scales[1]]) if y_cols is not None else x
    lr = group["lr"] = _lr(member.cfg, step)
    warm = getattr(member.cfg, member.sae.form.warm_up) if member.sae.form.warm_up else 0
    out = member.sae.training_forward(x, target, member.tracker.dead(member.cfg.dead_feature_window),
                                      coefficient_scale=min(1.0, (step + 1) / warm) if warm else 1.0)
    return out, target, lr
