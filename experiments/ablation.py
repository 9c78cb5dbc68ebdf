"""Zero, mean and resample ablation of heads, attention/MLP layers, neurons and experts.

Legend: B batch, P position, H n_heads, K d_head, D d_model, M d_mlp, k experts_per_token.

Where each kind is ablated (TransformerLens hook names):
  head        blocks.{l}.attn.hook_z [B, P, H, K], head ``index``
  attn_layer  blocks.{l}.hook_attn_out [B, P, D] (the attention output bias included)
  mlp_layer   blocks.{l}.hook_mlp_out [B, P, D]
  neuron      blocks.{l}.mlp.hook_post [B, P, M], neuron ``index`` (dense MLPs)
  expert      blocks.{l}.mlp.hook_expert_weights: expert ``index``'s router weight set to zero
              wherever it was chosen (the other chosen experts keep theirs; zero ablation only)
Methods: "zero" writes zeros; "mean" writes the mean over the reference prompts at each position
(pads excluded); "resample" writes the activation of another prompt (reference row b % n_ref, or,
when the reference is the input batch itself, row (b + 1) % B).

A mean reference is computed batch by batch (``mean_reference``, through
``experiments.datasets.mean_activations``), so a big corpus never needs one giant cache; a
precomputed one passes as ``reference_means`` ({hook name: [1, P, ...]}).

Padded batches: prompts of different lengths take ``attention_mask`` [B, P] (1 real, 0 pad; a
list of texts builds its own), and so does a padded reference (``reference_mask``). A reference is
read at each prompt's own positions: the p-th real token of an input row takes the reference's
p-th real token, whichever side either batch is padded on, so a padded row is ablated exactly as
that prompt would be alone. ``ablation_effect`` scores a metric (``experiments.metrics``: each
row read at its own last real token by default) clean and ablated, as the mean over prompts or
per prompt.

``python -m experiments.ablation --model NAME --out DIR [--prompt TEXT ...]`` runs a zero-ablation
``head_sweep`` and writes the per-head loss change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from experiments._batched import DEFAULT_TOKENS_PER_PASS, Edit, metric_from_final_resid, score_edits, unedited_run
from experiments._progress import ProgressArg
from experiments._tokens import TokensLike, str_tokens
from experiments.datasets import IOIDataset, mean_activations
from experiments.metrics import (LogitDiff, Metric, MetricLike, PositionSelector, PromptBatch, as_metric, per_prompt_table,
                                 prompt_batch, require_per_prompt_values)
from experiments.sites import Site
from workbench.errors import InputError

__all__ = ["AblationTarget", "ablation_hooks", "run_ablated", "head_sweep", "ablation_effect", "mean_reference",
           "per_token_loss_change", "top_predictions_change", "KINDS", "METHODS"]

Kind = Literal["head", "attn_layer", "mlp_layer", "neuron", "expert"]
Method = Literal["zero", "mean", "resample"]
KINDS: tuple[str, ...] = ("head", "attn_layer", "mlp_layer", "neuron", "expert")
METHODS: tuple[str, ...] = ("zero", "mean", "resample")
Hook = tuple[str, Callable]
# The value a hook writes: (rows, positions, each column's position in its own prompt or None) -> [rows or 1, positions, ...]
ValueOf = Callable[..., Tensor]


@dataclass(frozen=True)
class AblationTarget:
    """One thing to ablate: ``kind`` at ``layer``, with ``index`` the head, neuron or expert.

    Example:
        >>> AblationTarget("head", 3, 4).hook_name
        'blocks.3.attn.hook_z'
    """

    kind: Kind
    layer: int
    index: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"AblationTarget.kind must be one of {KINDS}, got {self.kind!r}")
        needs_index = self.kind in ("head", "neuron", "expert")
        if needs_index and self.index is None:
            raise InputError(f"AblationTarget of kind {self.kind!r} needs an index (which {self.kind})")
        if not needs_index and self.index is not None:
            raise InputError(f"AblationTarget of kind {self.kind!r} ablates the whole layer; index must be None")

    @property
    def hook_name(self) -> str:
        l = self.layer
        return {"head": f"blocks.{l}.attn.hook_z", "attn_layer": f"blocks.{l}.hook_attn_out",
                "mlp_layer": f"blocks.{l}.hook_mlp_out", "neuron": f"blocks.{l}.mlp.hook_post",
                "expert": f"blocks.{l}.mlp.hook_expert_weights"}[self.kind]

    @property
    def site(self) -> Site:
        """The slice this target's ablation writes (experts are ablated through the router instead).

        Example:
            >>> AblationTarget("neuron", 2, 7).site
            Site(hook_name='blocks.2.mlp.hook_post', position=None, index=7)
        """
        return Site(self.hook_name, index=self.index if self.kind in ("head", "neuron") else None)

    def check(self, cfg) -> None:
        """Raises InputError when this target does not exist in a model with config ``cfg``."""
        if not 0 <= self.layer < cfg.n_layers:
            raise InputError(f"{self}: layer must be in 0..{cfg.n_layers - 1}")
        if self.kind in ("mlp_layer", "neuron", "expert") and cfg.attn_only:
            raise InputError(f"{self}: this model is attention-only and has no MLP")
        if self.kind == "neuron" and self.layer in cfg.moe_layers:
            raise InputError(f"{self}: a mixture-of-experts layer has no single neuron axis; ablate an expert")
        if self.kind == "expert" and not cfg.is_moe:
            raise InputError(f"{self}: this model has no mixture of experts (num_experts=0)")
        if self.kind == "expert" and self.layer not in cfg.moe_layers:
            raise InputError(f"{self}: layer {self.layer} is a dense MLP layer with no experts; "
                             f"the mixture-of-experts layers are {cfg.moe_layers}")
        experts = cfg.layer_values("num_experts")[self.layer] if self.kind == "expert" else None
        size = {"head": cfg.n_heads, "neuron": cfg.layer_values("d_mlp")[self.layer], "expert": experts}.get(self.kind)
        if size is not None and not 0 <= self.index < size:
            raise InputError(f"{self}: index must be in 0..{size - 1}")


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise InputError(f"ablation method must be one of {METHODS}, got {method!r}")


def _token_positions(mask_BP: Optional[Tensor]) -> Optional[Tensor]:
    """Each column's position within its own prompt (its real tokens count from 0; a pad takes its
    neighbour's), or None when nothing is padding (column p is position p).

    Example:
        >>> _token_positions(torch.tensor([[0, 1, 1], [1, 1, 0]]).bool()).tolist()
        [[0, 0, 1], [0, 1, 1]]
    """
    if mask_BP is None:
        return None
    return (mask_BP.long().cumsum(1) - 1).clamp(min=0)


def _right_aligned(batch: PromptBatch) -> PromptBatch:
    """``batch`` with each row's real tokens moved to its front, in order: column p is the row's position p.

    A row runs as its prompt alone wherever its pads are, so its activations are unchanged, only aligned.

    Example:
        >>> _right_aligned(PromptBatch(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]).bool())).tokens.tolist()
        [[5, 6, 0]]
    """
    if batch.mask is None:
        return batch
    order = torch.sort((~batch.mask).to(torch.uint8), dim=1, stable=True).indices  # real columns first
    return PromptBatch(batch.tokens.gather(1, order), batch.mask.gather(1, order))


def _hook_names(hook_names) -> list[str]:
    names = [hook_names] if isinstance(hook_names, (str, AblationTarget)) else list(hook_names)
    return sorted({name.hook_name if isinstance(name, AblationTarget) else name for name in names})


@torch.no_grad()
def mean_reference(model, reference_tokens: TokensLike, hook_names: Union[str, AblationTarget, Sequence],
                   reference_mask: Optional[Tensor] = None, padding_side: str = "right", batch_size: int = 8,
                   progress: ProgressArg = False) -> dict[str, Tensor]:
    """The mean activation at each position over reference prompts, pads excluded: {hook name: [1, P, ...]}.

    ``hook_names``: hook names or ``AblationTarget``s. Each prompt is read at its own positions (a
    left-padded row's first real token is position 0); the mean at position p is over the prompts
    that have a p-th token (zeros where none has). Computed ``batch_size`` rows at a time by
    ``experiments.datasets.mean_activations``, never one cache of the whole reference. Pass the
    result as ``reference_means=`` to ``ablation_hooks``, ``run_ablated``, ``ablation_effect``,
    ``per_token_loss_change`` or ``top_predictions_change``.

    Example:
        >>> means = mean_reference(model, corpus_windows(model, texts, 64), [AblationTarget("head", 3, 1)])   # doctest: +SKIP
        >>> ablation_effect(model, prompts, [AblationTarget("head", 3, 1)], method="mean", reference_means=means)   # doctest: +SKIP
    """
    batch = _right_aligned(prompt_batch(model, reference_tokens, reference_mask, padding_side))
    return mean_activations(model, batch.tokens, _hook_names(hook_names), batch_size=batch_size, progress=progress,
                            attention_mask=batch.mask)


def _checked_means(reference_means: dict, hook_names: set[str]) -> dict[str, Tensor]:
    """The precomputed means of ``hook_names``, each [1, P, ...]."""
    if not isinstance(reference_means, dict):
        raise InputError(f"reference_means must be a dict {{hook name: mean activation [1, pos, ...]}}, "
                         f"got {type(reference_means).__name__}")
    missing = sorted(hook_names - set(reference_means))
    if missing:
        raise InputError(f"reference_means has no mean for {missing} (it has {sorted(reference_means)}); compute it with "
                         f"mean_reference(model, reference_tokens, targets)")
    for name in hook_names:
        mean = reference_means[name]
        if not isinstance(mean, Tensor) or mean.ndim < 2 or mean.shape[0] != 1:
            shape = tuple(mean.shape) if isinstance(mean, Tensor) else type(mean).__name__
            raise InputError(f"reference_means[{name!r}] must be a tensor [1, pos, ...] (a batch of one), got {shape}")
    return {name: reference_means[name] for name in hook_names}


def _short_reference(method: str, have: int, need: int, detail: str = "") -> InputError:
    return InputError(f"{method} ablation: the reference has {have} positions, fewer than the input's {need}{detail}; "
                      f"give reference prompts at least as long as the input's")


def _mean_value(mean_1P_: Tensor, n_positions: int) -> ValueOf:
    """Writes the mean at each row's own positions (the first ``n_positions`` of the mean are real)."""
    def value(batch: int, pos: int, positions_BP: Optional[Tensor] = None) -> Tensor:
        need = pos if positions_BP is None else int(positions_BP.max()) + 1
        if need > n_positions:
            raise _short_reference("mean", n_positions, need)
        if positions_BP is None:
            return mean_1P_[:, :pos]
        return mean_1P_[0][positions_BP.to(mean_1P_.device)]

    return value


def _resample_value(act_RP_: Tensor, lengths_R: Tensor, shift: int) -> ValueOf:
    """Writes reference row (b + shift) % n_ref at input row b's own positions (rows right-aligned)."""
    n_ref = act_RP_.shape[0]

    def value(batch: int, pos: int, positions_BP: Optional[Tensor] = None) -> Tensor:
        if shift and n_ref < 2:
            raise InputError("resample ablation needs another prompt: pass reference_tokens or a batch of 2+")
        rows = (torch.arange(batch, device=act_RP_.device) + shift) % n_ref
        need = (torch.full((batch,), pos, device=act_RP_.device) if positions_BP is None
                else positions_BP.to(act_RP_.device).max(1).values + 1)
        short = (need > lengths_R.to(act_RP_.device)[rows]).nonzero().flatten()
        if len(short):
            b = int(short[0])
            raise _short_reference("resample", int(lengths_R[rows[b]]), int(need[b]),
                                   f" (input row {b} takes reference row {int(rows[b])})")
        if positions_BP is None:
            return act_RP_[rows, :pos]
        return act_RP_[rows[:, None], positions_BP.to(act_RP_.device)]

    return value


def _reference_values(model, hook_names: set[str], method: str, reference_BP: Optional[TokensLike],
                      resample_shift: int = 0, *, reference_mask: Optional[Tensor] = None,
                      reference_means: Optional[dict] = None, padding_side: str = "right") -> dict[str, ValueOf]:
    """For each hook: a function ``(batch, pos, positions=None)`` -> replacement activation [batch or 1, pos, ...].

    ``positions`` [batch, pos] is each input column's position in its own prompt (a padded input;
    ``_token_positions``); None reads column p as position p. A padded reference is aligned the same
    way, and a mean excludes its pads. ``reference_means`` replaces the reference prompts of "mean".
    """
    hook_names = set(hook_names)
    if method == "mean":
        if reference_means is not None:
            return {name: _mean_value(mean, mean.shape[1])
                    for name, mean in _checked_means(reference_means, hook_names).items()}
        batch = _right_aligned(prompt_batch(model, reference_BP, reference_mask, padding_side))
        means = mean_activations(model, batch.tokens, sorted(hook_names), attention_mask=batch.mask)
        n_positions = batch.tokens.shape[1] if batch.mask is None else int(batch.mask.sum(1).max())
        return {name: _mean_value(means[name], n_positions) for name in hook_names}
    batch = _right_aligned(prompt_batch(model, reference_BP, reference_mask, padding_side))
    layers = [model.layer_of(name) for name in hook_names]
    stop = None if None in layers else max(layers) + 1  # the run stops after the last hooked block
    _, cache = model.run_with_cache(batch.tokens, attention_mask=batch.mask, stop_at_layer=stop,
                                    names_filter=lambda name: name in hook_names)
    n_ref, p_ref = batch.tokens.shape
    lengths_R = torch.full((n_ref,), p_ref) if batch.mask is None else batch.mask.sum(1).cpu()
    return {name: _resample_value(cache[name], lengths_R, resample_shift) for name in hook_names}


def _expert_hooks(layer: int, experts: set[int]) -> list[Hook]:
    """Zeroes the router weight of ``experts`` wherever they were chosen in ``layer``.

    ``hook_expert_weights`` runs before ``hook_expert_indices`` and both are used only after
    the second, so the weights are kept from the first hook and masked once the indices are known.
    """
    kept: dict[str, Tensor] = {}
    expert_ids = torch.tensor(sorted(experts))

    def keep_weights(weights_BPk: Tensor, hook) -> Tensor:
        kept["weights"] = weights_BPk.clone()
        return kept["weights"]

    def drop_experts(indices_BPk: Tensor, hook) -> Tensor:
        kept.pop("weights").masked_fill_(torch.isin(indices_BPk, expert_ids.to(indices_BPk.device)), 0)
        return indices_BPk

    return [(f"blocks.{layer}.mlp.hook_expert_weights", keep_weights),
            (f"blocks.{layer}.mlp.hook_expert_indices", drop_experts)]


@torch.no_grad()
def ablation_hooks(model, targets: Sequence[AblationTarget], method: Method = "zero",
                   reference_tokens: Optional[TokensLike] = None, *, resample_shift: int = 0,
                   reference_mask: Optional[Tensor] = None, reference_means: Optional[dict] = None,
                   attention_mask: Optional[Tensor] = None, padding_side: str = "right") -> list[Hook]:
    """Forward hooks (name, fn) that ablate ``targets``; pass them to ``model.run_with_hooks``.

    "mean" needs ``reference_tokens`` (the mean over them at each position, pads excluded) or a
    precomputed ``reference_means`` ({hook name: [1, P, ...]}, e.g. from ``mean_reference`` over a
    corpus); "resample" needs ``reference_tokens`` and gives input row b the activation of reference
    row (b + resample_shift) % n_ref. A padded reference takes ``reference_mask`` (a list of texts
    pads on ``padding_side`` and builds it). The reference must have at least the input's positions.

    ``attention_mask`` is the mask of the input the hooks will run on: with it each padded row reads
    the reference at its own positions (its p-th real token takes position p); without it column p
    is position p (right padding or none).

    Example:
        >>> hooks = ablation_hooks(model, [AblationTarget("head", 1, 0)], "mean", reference_tokens=ref)   # doctest: +SKIP
        >>> model.run_with_hooks(tokens, return_type="loss", fwd_hooks=hooks)                              # doctest: +SKIP
    """
    _check_method(method)
    targets = list(targets)
    if not targets:
        raise InputError("no ablation targets given")
    for target in targets:
        target.check(model.cfg)
    hooks: list[Hook] = []
    experts: dict[int, set[int]] = {}
    for target in (t for t in targets if t.kind == "expert"):
        if method != "zero":
            raise InputError(f"{target}: experts support zero ablation only, got method {method!r}")
        experts.setdefault(target.layer, set()).add(target.index)
    for layer, ids in experts.items():
        hooks += _expert_hooks(layer, ids)
    others = [t for t in targets if t.kind != "expert"]
    if method == "zero":
        values = {}
    else:
        if reference_means is not None and (method != "mean" or reference_tokens is not None):
            raise InputError("reference_means is a precomputed mean: it serves method='mean' in place of "
                             "reference_tokens; give one of them" if method == "mean" else
                             f"reference_means serves mean ablation only; {method} ablation needs reference_tokens")
        if reference_tokens is None and reference_means is None:
            raise InputError(f"{method} ablation needs reference_tokens (the prompts whose activations replace the "
                             f"input's)" + (" or reference_means" if method == "mean" else ""))
        values = _reference_values(model, {t.hook_name for t in others}, method, reference_tokens, resample_shift,
                                   reference_mask=reference_mask, reference_means=reference_means,
                                   padding_side=padding_side)
    positions_BP = None if attention_mask is None else _token_positions(_as_mask(attention_mask))
    for target in others:
        value_of = values.get(target.hook_name)

        def ablate(activation: Tensor, hook, site=target.site, value_of=value_of) -> Tensor:
            value = None if value_of is None else value_of(*activation.shape[:2], _positions_for(positions_BP, activation))
            return site.write(activation.clone(), value)

        hooks.append((target.hook_name, ablate))
    return hooks


def _as_mask(attention_mask: Tensor) -> Tensor:
    mask = torch.as_tensor(attention_mask)
    mask = mask[None] if mask.ndim == 1 else mask
    if mask.ndim != 2:
        raise InputError(f"attention_mask must be [batch, pos] (1 real, 0 pad), got shape {tuple(mask.shape)}")
    return mask.bool()


def _positions_for(positions_BP: Optional[Tensor], activation: Tensor) -> Optional[Tensor]:
    """The input's own positions for an activation [B, P', ...] (P' <= P: a run may leave out the last positions)."""
    if positions_BP is None:
        return None
    B, P = activation.shape[:2]
    if positions_BP.shape[0] != B or positions_BP.shape[1] < P:
        raise InputError(f"the ablation hooks were built for an attention_mask of shape {tuple(positions_BP.shape)} "
                         f"but ran on an activation of {B} rows and {P} positions; pass the input's own mask")
    return positions_BP[:, :P]


def _hooks_for_input(model, batch: PromptBatch, targets, method: str, reference_tokens,
                     reference_mask: Optional[Tensor] = None, reference_means: Optional[dict] = None,
                     padding_side: str = "right") -> list[Hook]:
    """Hooks for ``batch``, where a missing reference means the batch itself (resample: its next row)."""
    if reference_tokens is None and reference_means is None and method != "zero":
        return ablation_hooks(model, targets, method, batch.tokens, resample_shift=1 if method == "resample" else 0,
                              reference_mask=batch.mask, attention_mask=batch.mask)
    return ablation_hooks(model, targets, method, reference_tokens, reference_mask=reference_mask,
                          reference_means=reference_means, attention_mask=batch.mask, padding_side=padding_side)


def run_ablated(model, tokens: TokensLike, targets: Sequence[AblationTarget], method: Method = "zero",
                reference_tokens: Optional[TokensLike] = None, return_type: Optional[str] = "logits", *,
                attention_mask: Optional[Tensor] = None, padding_side: str = "right",
                reference_mask: Optional[Tensor] = None, reference_means: Optional[dict] = None):
    """Runs the model with ``targets`` ablated; returns what ``model(..., return_type=)`` returns.

    Without a reference, "mean" uses the input batch's own mean (pads excluded) and "resample"
    gives each row the activations of the next row. A padded batch takes ``attention_mask`` (a list
    of texts builds it, padded on ``padding_side``); the mask reaches the ablated run and, when the
    input is its own reference, the reference run. ``reference_mask`` / ``reference_means`` as in
    ``ablation_hooks``.

    Example:
        >>> run_ablated(model, tokens, [AblationTarget("attn_layer", 0)], return_type="loss")   # doctest: +SKIP
        >>> run_ablated(model, ["a b c", "a"], [AblationTarget("head", 0, 1)], "mean")          # padded, masked   # doctest: +SKIP
    """
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    hooks = _hooks_for_input(model, batch, targets, method, reference_tokens, reference_mask, reference_means,
                             padding_side)
    return model.run_with_hooks(batch.tokens, attention_mask=batch.mask, return_type=return_type, fwd_hooks=hooks)


def head_sweep(model, tokens: TokensLike, metric: MetricLike = "loss", method: Method = "zero",
               reference_tokens: Optional[TokensLike] = None, progress: ProgressArg = True,
               tokens_per_pass: int = DEFAULT_TOKENS_PER_PASS, *, position: Optional[PositionSelector] = None,
               per_prompt: bool = False, attention_mask: Optional[Tensor] = None,
               padding_side: str = "right", reference_mask: Optional[Tensor] = None,
               reference_means: Optional[dict] = None) -> pd.DataFrame:
    """Ablates every (layer, head) in turn and scores it: DataFrame[layer, head, metric, delta].

    ``metric`` is "loss" (each prompt's mean next-token loss over its real tokens), a built-in
    ``experiments.metrics`` metric (``LogitDiff``, ``TokenProbability``: one position per row, the
    fast path) or a callable ``(logits, tokens) -> scalar or [batch]`` over the logits at
    ``position`` ("all" by default for a callable; "last" is each row's last real token).
    ``delta`` is ablated minus clean. Values are means over prompts; ``per_prompt=True`` gives a
    ``prompt`` column instead. A padded batch takes ``attention_mask`` (a list of texts builds it);
    "mean" and "resample" read the reference as ``ablation_hooks`` does (``reference_mask``,
    ``reference_means``; without a reference, the input batch itself, pads excluded).
    The clean run's residual stream is reused up to each head's layer and many heads are ablated
    per batched pass (see ``experiments._batched``), so this is several times faster than one
    ``run_with_hooks`` per head, with the same result.

    Example:
        >>> df = head_sweep(model, model.to_tokens("The cat sat on the mat."), progress=False)   # doctest: +SKIP
        >>> df.sort_values("delta", ascending=False).head()                                      # doctest: +SKIP
    """
    _check_method(method)
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    metric = as_metric(metric, position)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    z_names = [f"blocks.{l}.attn.hook_z" for l in range(L)]
    clean_R, resid_pre, _ = unedited_run(model, batch, metric)
    values = {}
    if method != "zero":
        own = reference_tokens is None and reference_means is None  # the input batch is its own reference
        shift = 1 if (method == "resample" and own) else 0
        with torch.no_grad():
            values = _reference_values(model, set(z_names), method, batch.tokens if own else reference_tokens, shift,
                                       reference_mask=batch.mask if own else reference_mask,
                                       reference_means=reference_means, padding_side=padding_side)
    B, P = batch.tokens.shape
    positions_BP = _token_positions(batch.mask)
    edits = []
    for layer in range(L):
        value = values[z_names[layer]](B, P, positions_BP) if values else None
        edits += [Edit(AblationTarget("head", layer, head).site, value) for head in range(H)]
    scores_nR = score_edits(model, resid_pre, batch, edits, metric, progress, tokens_per_pass, desc="head sweep")
    labels = pd.DataFrame({"layer": np.repeat(np.arange(L), H), "head": np.tile(np.arange(H), L)})
    if per_prompt:
        table = per_prompt_table(labels, scores_nR, batch.size, "head sweep")
        table["delta"] = table["metric"] - clean_R.numpy()[table["prompt"]]
    else:
        table = labels.assign(metric=scores_nR.mean(1).numpy())
        table["delta"] = table["metric"] - float(clean_R.mean())
    table.attrs.update(clean_metric=float(clean_R.mean()), clean_metric_per_prompt=clean_R.tolist())
    return table


def _one_row(batch: PromptBatch, row: int) -> tuple[int, Tensor]:
    """``row`` (negative from the end) checked against the batch, and that row's real columns (bool [P])."""
    if not -batch.size <= row < batch.size:
        raise InputError(f"row={row} is outside the batch of {batch.size} prompt(s)")
    row %= batch.size
    real_P = batch.mask[row] if batch.mask is not None else torch.ones_like(batch.tokens[row], dtype=torch.bool)
    return row, real_P


@torch.no_grad()
def per_token_loss_change(model, tokens: TokensLike, targets: Sequence[AblationTarget], method: Method = "zero",
                          reference_tokens: Optional[TokensLike] = None, *, row: int = 0,
                          attention_mask: Optional[Tensor] = None, padding_side: str = "right",
                          reference_mask: Optional[Tensor] = None,
                          reference_means: Optional[dict] = None) -> pd.DataFrame:
    """Loss of predicting each token of prompt ``row``, clean and ablated.

    Row ``position`` p is the loss of predicting the prompt's token p from its positions < p
    (p >= 1), counted over the prompt's real tokens only: a padded row gives the table of its
    prompt alone. The whole batch runs (it is the default reference of "mean" and "resample");
    ``attention_mask``, ``padding_side``, ``reference_mask`` and ``reference_means`` as in ``run_ablated``.

    Example:
        >>> per_token_loss_change(model, tokens, [AblationTarget("head", 1, 4)]).nlargest(5, "delta")   # doctest: +SKIP
        >>> per_token_loss_change(model, ["a b c", "a b"], [AblationTarget("head", 1, 4)], row=1)       # doctest: +SKIP
    """
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    row, real_P = _one_row(batch, row)
    hooks = _hooks_for_input(model, batch, targets, method, reference_tokens, reference_mask, reference_means,
                             padding_side)
    clean = model(batch.tokens, attention_mask=batch.mask, return_type="loss", loss_per_token=True)[row]
    ablated = model.run_with_hooks(batch.tokens, attention_mask=batch.mask, return_type="loss", loss_per_token=True,
                                   fwd_hooks=hooks)[row]
    scored = real_P[:-1] & real_P[1:]  # loss p predicts column p + 1 from column p
    if not bool(scored.any()):
        raise InputError(f"prompt {row} has fewer than two real tokens: no next-token loss to show")
    clean, ablated = clean[scored].float().cpu(), ablated[scored].float().cpu()
    positions = (real_P.long().cumsum(0) - 1)[1:][scored]  # each predicted token's position in its prompt
    return pd.DataFrame({"position": positions.cpu().numpy(), "token": str_tokens(model, batch.tokens[row, 1:][scored]),
                         "clean_loss": clean.numpy(), "ablated_loss": ablated.numpy(),
                         "delta": (ablated - clean).numpy()})


@torch.no_grad()
def top_predictions_change(model, tokens: TokensLike, targets: Sequence[AblationTarget], method: Method = "zero",
                           k: int = 5, reference_tokens: Optional[TokensLike] = None,
                           position: Union[int, Literal["last"]] = "last", *, row: int = 0,
                           attention_mask: Optional[Tensor] = None, padding_side: str = "right",
                           reference_mask: Optional[Tensor] = None,
                           reference_means: Optional[dict] = None) -> pd.DataFrame:
    """The top-k next-token predictions of prompt ``row`` at ``position``, clean beside ablated.

    ``position`` is "last" (the prompt's last real token) or an index into the prompt's real tokens
    (negative from its end), so a padded row reads as its prompt alone. Arguments as
    ``per_token_loss_change``.

    Columns: rank, clean_token, clean_token_id, clean_prob, ablated_token, ablated_token_id,
    ablated_prob, and ablated_prob_of_clean (how the clean prediction fares after ablation).

    Example:
        >>> top_predictions_change(model, "The Eiffel Tower is in", [AblationTarget("mlp_layer", 5)], "zero")   # doctest: +SKIP
    """
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    row, real_P = _one_row(batch, row)
    columns = real_P.nonzero().flatten()
    index = -1 if position == "last" else position
    if isinstance(index, str) or not -len(columns) <= int(index) < len(columns):
        raise InputError(f"position must be 'last' or an index into prompt {row}'s {len(columns)} real tokens, "
                         f"got {position!r}")
    column = int(columns[int(index)])
    hooks = _hooks_for_input(model, batch, targets, method, reference_tokens, reference_mask, reference_means,
                             padding_side)
    clean = model(batch.tokens, attention_mask=batch.mask)[row, column].float().softmax(-1)
    ablated = model.run_with_hooks(batch.tokens, attention_mask=batch.mask,
                                   fwd_hooks=hooks)[row, column].float().softmax(-1)
    clean_p, clean_ids = clean.topk(k)
    ablated_p, ablated_ids = ablated.topk(k)
    return pd.DataFrame({
        "rank": np.arange(1, k + 1),
        "clean_token": str_tokens(model, clean_ids.cpu()), "clean_token_id": clean_ids.cpu().numpy(),
        "clean_prob": clean_p.cpu().numpy(),
        "ablated_token": str_tokens(model, ablated_ids.cpu()), "ablated_token_id": ablated_ids.cpu().numpy(),
        "ablated_prob": ablated_p.cpu().numpy(),
        "ablated_prob_of_clean": ablated[clean_ids].cpu().numpy(),
    })


def _metric_of_run(model, batch: PromptBatch, metric: Metric, hooks: list[Hook]) -> Tensor:
    """The metric of each row ([B], or [1] for a batch-level metric) of one run under ``hooks``.

    Read from the final residual stream (``_batched.metric_from_final_resid``): a metric at one
    position per row unembeds only those positions, and the loss is tiled, never [B, P, V] at once.
    """
    # stop_at_layer=n_layers: the blocks run and nothing is unembedded (return_type=None still would be).
    resid_BPD = model.run_with_hooks(batch.tokens, attention_mask=batch.mask, stop_at_layer=model.cfg.n_layers,
                                     fwd_hooks=list(hooks))
    return metric_from_final_resid(model, resid_BPD, batch, metric)[0].float().cpu()


@torch.no_grad()
def ablation_effect(model, tokens: TokensLike, targets: Sequence[AblationTarget], metric: MetricLike = "loss",
                    method: Method = "zero", reference_tokens: Optional[TokensLike] = None, *,
                    position: Optional[PositionSelector] = None, per_prompt: bool = False,
                    attention_mask: Optional[Tensor] = None, padding_side: str = "right",
                    reference_mask: Optional[Tensor] = None,
                    reference_means: Optional[dict] = None) -> pd.DataFrame:
    """The metric of the clean and the ablated run: DataFrame[clean, ablated, delta], delta = ablated - clean.

    ``metric``: "loss" (each prompt's mean next-token loss over its real tokens), an
    ``experiments.metrics`` metric (``LogitDiff``, ``TokenProbability``; e.g. ``logit_diff(model,
    answers, wrongs, rows=B)`` with one answer per prompt) or a callable ``(logits, tokens) -> scalar or
    [batch]`` over the logits at ``position`` ("last": each row's last real token). One row holding
    the means over prompts, or with ``per_prompt=True`` one row per prompt (a ``prompt`` column
    first). A padded batch takes ``attention_mask`` (a list of texts builds it); the reference
    arguments are ``run_ablated``'s. With a fixed reference (or zero ablation) the batch's values are
    the means of each prompt's values run alone. ``df.attrs`` holds the per-prompt lists too.

    Example:
        >>> ablation_effect(model, ["When Mary and John went", "Hi there"], [AblationTarget("head", 0, 1)])   # doctest: +SKIP
           clean  ablated  delta
        0  4.107    4.392  0.285
    """
    _check_method(method)
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    metric = as_metric(metric, position)
    hooks = _hooks_for_input(model, batch, targets, method, reference_tokens, reference_mask, reference_means,
                             padding_side)
    clean_R = _metric_of_run(model, batch, metric, [])
    ablated_R = _metric_of_run(model, batch, metric, hooks)
    if per_prompt:
        require_per_prompt_values(len(clean_R), batch.size, "ablation")
        table = pd.DataFrame({"prompt": np.arange(batch.size), "clean": clean_R.numpy(), "ablated": ablated_R.numpy()})
    else:
        table = pd.DataFrame({"clean": [float(clean_R.mean())], "ablated": [float(ablated_R.mean())]})
    table["delta"] = table["ablated"] - table["clean"]
    table.attrs.update(method=method, targets=[str(t) for t in targets], clean_metric_per_prompt=clean_R.tolist(),
                       ablated_metric_per_prompt=ablated_R.tolist())
    return table


@torch.no_grad()
def head_sweep_per_prompt(model, tokens: Union[IOIDataset, Tensor, Sequence[str]], metric="loss",
                          method: str = "zero", *, attention_mask: Optional[Tensor] = None,
                          reference_tokens=None, reference_mask: Optional[Tensor] = None,
                          reference_means: Optional[dict] = None, position=None,
                          progress: ProgressArg = False) -> pd.DataFrame:
    """``head_sweep(..., per_prompt=True)`` with each prompt's unablated metric: DataFrame[prompt, layer, head, clean, metric, delta].

    ``tokens`` may be an ``IOIDataset`` (its clean prompts and mask; ``metric="logit_diff"`` is its
    IO-minus-S logit difference). "mean" and "resample" need a fixed reference (``reference_tokens``
    or ``reference_means``): a shard is not the whole dataset, so its own mean would differ.

    Example:
        >>> rows = run_sharded(head_sweep_per_prompt, windows_BP, "smollm2-135m")   # doctest: +SKIP
        >>> mean_over_prompts(rows, ["layer", "head"])     # == head_sweep(model, windows_BP)   # doctest: +SKIP
    """
    if method != "zero" and reference_tokens is None and reference_means is None:
        raise InputError(f"{method} ablation over shards needs reference_tokens or reference_means: each shard would "
                         f"otherwise use its own prompts as the reference, and shards would disagree")
    if isinstance(tokens, IOIDataset):
        data, tokens, attention_mask = tokens, tokens.clean_tokens, tokens.clean_mask
        if isinstance(metric, str) and metric == "logit_diff":
            metric = LogitDiff(data.answer_tokens, data.wrong_tokens)
    table = head_sweep(model, tokens, metric, method, reference_tokens, progress, position=position, per_prompt=True,
                       attention_mask=attention_mask, reference_mask=reference_mask, reference_means=reference_means)
    clean = np.asarray(table.attrs["clean_metric_per_prompt"], dtype=table["metric"].dtype)
    table["clean"] = clean[table["prompt"].to_numpy()]
    table = table.sort_values(["prompt", "layer", "head"], kind="stable", ignore_index=True)
    return table[["prompt", "layer", "head", "clean", "metric", "delta"]]


def main(argv: Optional[Sequence[str]] = None) -> None:
    from experiments import _cli
    from experiments.figures import scores_heatmap

    parser = _cli.make_parser("Ablate every head in turn and record the change in loss (mean over the prompts).",
                              "ablation", per_prompt=True)
    parser.add_argument("--prompt", action="append", default=None,
                        help="text to run; repeat it for several prompts (default: a fixed example)")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    prompts = args.prompt or [None]
    if len(prompts) == 1:
        tokens, mask = _cli.prompt_tokens(model, prompts[0]), None
    elif model.tokenizer is None:
        raise SystemExit("this model has no tokenizer, so --prompt cannot be tokenized")
    else:
        tokens, mask = model.to_tokens_and_mask(prompts)
    # Zero ablation: mean and resample over these prompts would replace each by the others (or itself).
    if _cli.sharded(args):
        from experiments import distributed

        with _cli.worker_pool(args) as pool:
            rows = pool.run(head_sweep_per_prompt, tokens, attention_mask=mask,
                            progress=not args.no_progress)
        table = distributed.mean_over_prompts(rows.drop(columns="clean"), ["layer", "head"])
    else:
        table = head_sweep(model, tokens, "loss", "zero", progress=not args.no_progress, attention_mask=mask)
    deltas = torch.tensor(table.delta.values).view(model.cfg.n_layers, model.cfg.n_heads)
    fig = scores_heatmap(deltas, "Loss change when zero-ablating each head", colorscale="RdBu_r",
                         zmid=0.0, value_name="delta loss")
    _cli.write_outputs(args.out, "head_sweep", table, fig,
                       {"experiment": "head_sweep", "model": args.model, "method": "zero",
                        "n_prompts": len(prompts), "n_tokens": int(tokens.numel() if mask is None else mask.sum())})


if __name__ == "__main__":
    from experiments._cli import run_main

    run_main(main)
