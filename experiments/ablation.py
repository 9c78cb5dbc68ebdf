"""Zero, mean and resample ablation of heads, attention/MLP layers, neurons and experts.

Legend: B batch, P position, H n_heads, K d_head, D d_model, M d_mlp, k experts_per_token.

Where each kind is ablated (TransformerLens hook names):
  head        blocks.{l}.attn.hook_z [B, P, H, K], head ``index``
  attn_layer  blocks.{l}.hook_attn_out [B, P, D] (the attention output bias included)
  mlp_layer   blocks.{l}.hook_mlp_out [B, P, D]
  neuron      blocks.{l}.mlp.hook_post [B, P, M], neuron ``index`` (dense MLPs)
  expert      blocks.{l}.mlp.hook_expert_weights: expert ``index``'s router weight set to zero
              wherever it was chosen (the other chosen experts keep theirs; zero ablation only)
Methods: "zero" writes zeros; "mean" writes the reference batch's mean at each position;
"resample" writes the activation of another prompt (reference row b % n_ref, or, when the
reference is the input batch itself, row (b + 1) % B).

``python -m experiments.ablation --model NAME --out DIR [--prompt TEXT]`` runs a zero-ablation
``head_sweep`` and writes the per-head loss change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from experiments._batched import DEFAULT_TOKENS_PER_PASS, Edit, score_edits, unedited_run
from experiments._progress import ProgressArg
from experiments._tokens import TokensLike, str_tokens
from experiments.metrics import MetricLike, PositionSelector, as_metric, per_prompt_table, prompt_batch
from experiments.sites import Site
from workbench.errors import InputError

__all__ = ["AblationTarget", "ablation_hooks", "run_ablated", "head_sweep", "per_token_loss_change",
           "top_predictions_change", "KINDS", "METHODS"]

Kind = Literal["head", "attn_layer", "mlp_layer", "neuron", "expert"]
Method = Literal["zero", "mean", "resample"]
KINDS: tuple[str, ...] = ("head", "attn_layer", "mlp_layer", "neuron", "expert")
METHODS: tuple[str, ...] = ("zero", "mean", "resample")
Hook = tuple[str, Callable]


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
        if self.kind == "neuron" and cfg.is_moe:
            raise InputError(f"{self}: a mixture-of-experts layer has no single neuron axis; ablate an expert")
        if self.kind == "expert" and not cfg.is_moe:
            raise InputError(f"{self}: this model has no mixture of experts (num_experts=0)")
        size = {"head": cfg.n_heads, "neuron": cfg.d_mlp, "expert": cfg.num_experts}.get(self.kind)
        if size is not None and not 0 <= self.index < size:
            raise InputError(f"{self}: index must be in 0..{size - 1}")


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise InputError(f"ablation method must be one of {METHODS}, got {method!r}")


def _reference_values(model, hook_names: set[str], method: str, reference_BP: Tensor,
                      resample_shift: int) -> dict[str, Callable[[int, int], Tensor]]:
    """For each hook: a function (batch, pos) -> replacement activation of that shape."""
    _, cache = model.run_with_cache(reference_BP, names_filter=lambda name: name in hook_names)
    n_ref, p_ref = reference_BP.shape

    def getter(act: Tensor) -> Callable[[int, int], Tensor]:
        mean = act.mean(0, keepdim=True) if method == "mean" else None

        def value(batch: int, pos: int) -> Tensor:
            if pos > p_ref:
                raise InputError(f"{method} ablation: the reference has {p_ref} positions, fewer than the input's {pos}")
            if method == "mean":
                return mean[:, :pos]
            if resample_shift and n_ref < 2:
                raise InputError("resample ablation needs another prompt: pass reference_tokens or a batch of 2+")
            rows = (torch.arange(batch) + resample_shift) % n_ref
            return act[rows.to(act.device), :pos]

        return value

    return {name: getter(cache[name]) for name in hook_names}


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
                   reference_tokens: Optional[TokensLike] = None, *, resample_shift: int = 0) -> list[Hook]:
    """Forward hooks (name, fn) that ablate ``targets``; pass them to ``model.run_with_hooks``.

    "mean" and "resample" need ``reference_tokens`` ([n_ref, p_ref] with p_ref >= the input's
    positions); "resample" gives input row b the activation of reference row (b + resample_shift) % n_ref.

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
        if reference_tokens is None:
            raise InputError(f"{method} ablation needs reference_tokens (the prompts whose activations replace the input's)")
        values = _reference_values(model, {t.hook_name for t in others}, method,
                                   model.as_tokens(reference_tokens), resample_shift)
    for target in others:
        value_of = values.get(target.hook_name)

        def ablate(activation: Tensor, hook, site=target.site, value_of=value_of) -> Tensor:
            value = None if value_of is None else value_of(activation.shape[0], activation.shape[1])
            return site.write(activation.clone(), value)

        hooks.append((target.hook_name, ablate))
    return hooks


def _hooks_for_input(model, tokens_BP: Tensor, targets, method: str, reference_tokens) -> list[Hook]:
    """Hooks where a missing reference means the input batch itself (resample: another row of it)."""
    if reference_tokens is None and method != "zero":
        return ablation_hooks(model, targets, method, tokens_BP, resample_shift=1 if method == "resample" else 0)
    return ablation_hooks(model, targets, method, reference_tokens)


def run_ablated(model, tokens: TokensLike, targets: Sequence[AblationTarget], method: Method = "zero",
                reference_tokens: Optional[TokensLike] = None, return_type: Optional[str] = "logits"):
    """Runs the model with ``targets`` ablated; returns what ``model(..., return_type=)`` returns.

    Without ``reference_tokens``, "mean" uses the input batch's own mean and "resample" gives
    each row the activations of the next row.

    Example:
        >>> run_ablated(model, tokens, [AblationTarget("attn_layer", 0)], return_type="loss")   # doctest: +SKIP
    """
    tokens_BP = model.as_tokens(tokens)
    hooks = _hooks_for_input(model, tokens_BP, targets, method, reference_tokens)
    return model.run_with_hooks(tokens_BP, return_type=return_type, fwd_hooks=hooks)


def head_sweep(model, tokens: TokensLike, metric: MetricLike = "loss", method: Method = "zero",
               reference_tokens: Optional[TokensLike] = None, progress: ProgressArg = True,
               tokens_per_pass: int = DEFAULT_TOKENS_PER_PASS, *, position: Optional[PositionSelector] = None,
               per_prompt: bool = False, attention_mask: Optional[Tensor] = None,
               padding_side: str = "right") -> pd.DataFrame:
    """Ablates every (layer, head) in turn and scores it: DataFrame[layer, head, metric, delta].

    ``metric`` is "loss" (each prompt's mean next-token loss over its real tokens), a built-in
    ``experiments.metrics`` metric (``LogitDiff``, ``TokenProbability``: one position per row, the
    fast path) or a callable ``(logits, tokens) -> scalar or [batch]`` over the logits at
    ``position`` ("all" by default for a callable; "last" is each row's last real token).
    ``delta`` is ablated minus clean. Values are means over prompts; ``per_prompt=True`` gives a
    ``prompt`` column instead. A padded batch takes ``attention_mask`` (a list of texts builds it).
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
        reference = batch.tokens if reference_tokens is None else model.as_tokens(reference_tokens)
        shift = 1 if (method == "resample" and reference_tokens is None) else 0
        with torch.no_grad():
            values = _reference_values(model, set(z_names), method, reference, shift)
    B, P = batch.tokens.shape
    edits = []
    for layer in range(L):
        value = values[z_names[layer]](B, P) if values else None
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


@torch.no_grad()
def per_token_loss_change(model, tokens: TokensLike, targets: Sequence[AblationTarget], method: Method = "zero",
                          reference_tokens: Optional[TokensLike] = None) -> pd.DataFrame:
    """Loss of predicting each token, clean and ablated (batch item 0).

    Row ``position`` p is the loss of predicting token p from positions < p (p >= 1).

    Example:
        >>> per_token_loss_change(model, tokens, [AblationTarget("head", 1, 4)]).nlargest(5, "delta")   # doctest: +SKIP
    """
    tokens_BP = model.as_tokens(tokens)
    clean = model(tokens_BP, return_type="loss", loss_per_token=True)[0]
    hooks = _hooks_for_input(model, tokens_BP, targets, method, reference_tokens)
    ablated = model.run_with_hooks(tokens_BP, return_type="loss", loss_per_token=True, fwd_hooks=hooks)[0]
    return pd.DataFrame({"position": np.arange(1, tokens_BP.shape[1]), "token": str_tokens(model, tokens_BP[0, 1:]),
                         "clean_loss": clean.float().cpu().numpy(), "ablated_loss": ablated.float().cpu().numpy(),
                         "delta": (ablated - clean).float().cpu().numpy()})


@torch.no_grad()
def top_predictions_change(model, tokens: TokensLike, targets: Sequence[AblationTarget], method: Method = "zero",
                           k: int = 5, reference_tokens: Optional[TokensLike] = None,
                           position: int = -1) -> pd.DataFrame:
    """The top-k next-token predictions at ``position`` (batch item 0), clean beside ablated.

    Columns: rank, clean_token, clean_token_id, clean_prob, ablated_token, ablated_token_id,
    ablated_prob, and ablated_prob_of_clean (how the clean prediction fares after ablation).

    Example:
        >>> top_predictions_change(model, "The Eiffel Tower is in", [AblationTarget("mlp_layer", 5)], "zero")   # doctest: +SKIP
    """
    tokens_BP = model.as_tokens(tokens)
    clean = model(tokens_BP)[0, position].float().softmax(-1)
    ablated = run_ablated(model, tokens_BP, targets, method, reference_tokens)[0, position].float().softmax(-1)
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


def main(argv: Optional[Sequence[str]] = None) -> None:
    from experiments import _cli
    from experiments.figures import scores_heatmap

    parser = _cli.make_parser("Ablate every head in turn and record the change in loss.")
    parser.add_argument("--prompt", default=None, help="text to run (default: a fixed example)")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    tokens = _cli.prompt_tokens(model, args.prompt)
    # One prompt: mean and resample would replace it by itself, so the command zero-ablates.
    table = head_sweep(model, tokens, "loss", "zero", progress=not args.no_progress)
    deltas = torch.tensor(table.delta.values).view(model.cfg.n_layers, model.cfg.n_heads)
    fig = scores_heatmap(deltas, "Loss change when zero-ablating each head", colorscale="RdBu_r",
                         zmid=0.0, value_name="delta loss")
    _cli.write_outputs(args.out, "head_sweep", table, fig,
                       {"experiment": "head_sweep", "model": args.model, "method": "zero",
                        "n_tokens": int(tokens.numel())})


if __name__ == "__main__":
    from experiments._cli import run_main

    run_main(main)
