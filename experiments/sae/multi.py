"""``train_saes``: several SAEs and transcoders from one forward pass per batch (SAELens's ``MultiSAETrainingRunner``
in spirit); ``train_transcoders``: a per-layer ``wb.TranscoderSet`` trained that way.

One model forward per chunk captures every hook the specs name (each once, in the order first named); the rows go
through one shuffling buffer, so every SAE sees the same rows in the same order. Each SAE then trains on its own
columns of each batch, with its own scales, ``b_dec`` initialisation, learning-rate schedule, sparsity warm-up,
gradient clipping (norm 1 per SAE), dead-feature counters and log, and its own Adam moments (one Adam, a
parameter group per SAE: Adam's update of a parameter reads only that parameter's state, so the SAEs do not
interact). ``train_sae`` draws its initialisation and its data order from generators of their own seeded with
``seed``, so each SAE here ends exactly as ``train_sae`` would train it alone on the same data, seed and settings
(with ``outlier_norm_ratio`` set, a row that is an outlier at any hook is left out for every SAE).

The loop is the one ``train_sae`` runs (``experiments.sae.loop.train_members``, with a member per SAE): a
checkpoint here holds every SAE's state (as one
``nn.ModuleList``), the shared buffer and each SAE's scales and log rows, and is refused by a run of other specs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from experiments._progress import ProgressArg
from experiments.sae.checkpoints import run_identity
from experiments.sae.clt import INPUT_HOOK, OUTPUT_HOOK
from experiments.sae.inputs import check_hook, check_train_inputs, token_rows
from experiments.sae.loop import Member, hook_columns, train_members
from experiments.sae.modules import TrainingSAE
from experiments.sae.parallel import current_world
from experiments.sae.train import LOG_FILE, TrainSAEConfig, _config_overrides, saved_metadata, training_options
from workbench.errors import InputError
from workbench.sae import SAE
from workbench.transcoders import TranscoderSet

# TrainSAEConfig fields one SAE may set for itself (the rest describe the shared data stream).
PER_SAE_FIELDS = ("lr", "lr_warm_up_steps", "lr_decay_steps", "adam_beta1", "adam_beta2", "l1_coefficient", "lp_norm",
                  "l1_warm_up_steps", "l0_coefficient", "l0_warm_up_steps", "jumprelu_bandwidth",
                  "jumprelu_init_threshold", "aux_loss_coefficient", "topk_threshold_lr", "decoder_init_norm",
                  "matryoshka_widths", "use_matryoshka_aux_loss",
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
    columns = hook_columns(model, hooks, tokens)
    for spec, member in zip(specs, members):
        member.columns = (columns[spec.hook_name], columns.get(spec.hook_name_out))
    ensemble = nn.ModuleList([member.module for member in members])
    ensemble.architecture = "+".join(f"{s.label}:{s.architecture}" for s in specs)  # what a resume checks
    ensemble.options = {"k": [s.k for s in specs]}
    ensemble.n_features = sum(m.module.n_features for m in members)
    logs = train_members(model, members, tokens, hooks, cfg, torch.Generator().manual_seed(cfg.seed),
                         run_identity(ensemble, hooks, [], cfg, tokens), ensemble, activation_cache, checkpoint_dir,
                         resume_from, progress, desc=f"training {len(members)} SAEs", log_per_member=True)
    trained = []
    for spec, member, log in zip(specs, members, logs):
        sae = member.module.to_sae(saved_metadata(model, cfg, tokens, spec.hook_name, spec.hook_name_out),
                                   scale_in=member.scales[0][0], scale_out=member.scales[1][0], dtype=save_dtype)
        sae.training_log = log
        if out is not None and current_world().writes:  # data-parallel: rank 0 writes
            sae.save(Path(out) / spec.label)
            log.to_csv(Path(out) / spec.label / LOG_FILE, index=False)
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
    if out is not None and current_world().writes:
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


def _member(model, spec: SAESpec, cfg: TrainSAEConfig, tokens: Tensor) -> Member:
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
    return Member(sae, own)
