"""Activation patching from a clean run into a corrupted one, exact and by attribution.

Legend: B batch, P position, L n_layers, H n_heads, K d_head, D d_model, V d_vocab.

The metric is the logit difference logit[answer] - logit[wrong] at the last position (mean
over the batch). Exact patching replaces one activation of the corrupted run by the clean run's
and reruns the rest; every site is scored in batched passes that reuse the corrupted run up to
the site's layer (``experiments._batched``). ``normalized`` is (patched - corrupt) / (clean -
corrupt): 1 where the patch restores the clean behaviour, 0 where it does nothing.

Attribution patching is the gradient-based LINEAR APPROXIMATION of the same quantity (Nanda,
"Attribution Patching"): (clean - corrupt) . d metric / d activation at the corrupted run,
for every site at once from one clean forward, one corrupted forward and one backward pass.

``python -m experiments.patching --model NAME --out DIR [--clean TEXT --corrupt TEXT --answer TEXT --wrong TEXT]``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Int
from plotly.subplots import make_subplots
from torch import Tensor

from experiments._batched import Edit, PositionMetric, score_edits, unedited_run
from experiments._progress import ProgressArg
from experiments._tokens import TokensLike, axis_labels, str_tokens
from experiments.figures import labelled_heatmap, scores_heatmap
from experiments.sites import Site
from workbench.errors import InputError

TokenId = Union[int, Int[Tensor, "batch"]]
SITES = {"resid": "hook_resid_pre", "attn": "hook_attn_out", "mlp": "hook_mlp_out", "heads": "attn.hook_z"}


@dataclass(frozen=True, eq=False)
class LogitDiff(PositionMetric):
    """logits[b, position, answer_b] - logits[b, position, wrong_b], averaged over the batch."""

    answer_token: TokenId
    wrong_token: TokenId
    position: int = -1

    def from_logits(self, logits_BV: Tensor, tokens: Optional[Tensor] = None) -> Tensor:
        logits_BV = logits_BV.float()
        rows = torch.arange(logits_BV.shape[0], device=logits_BV.device)
        answer = torch.as_tensor(self.answer_token, device=logits_BV.device).expand(logits_BV.shape[0])
        wrong = torch.as_tensor(self.wrong_token, device=logits_BV.device).expand(logits_BV.shape[0])
        return (logits_BV[rows, answer] - logits_BV[rows, wrong]).mean()


def logit_diff_metric(answer_token: TokenId, wrong_token: TokenId, position: int = -1) -> LogitDiff:
    """metric(logits [B, P, V], tokens) = mean over b of logits[b, position, answer_b] - logits[b, position, wrong_b].

    Example:
        >>> logit_diff_metric(2, 0)(torch.tensor([[[1.0, 0.0, 3.0]]]), None).item()
        2.0
    """
    return LogitDiff(answer_token, wrong_token, position)


def _pair(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike) -> tuple[Tensor, Tensor]:
    clean, corrupt = model.as_tokens(clean_tokens), model.as_tokens(corrupt_tokens)
    if clean.shape != corrupt.shape:
        raise InputError(f"clean and corrupted tokens must have the same shape to patch position by position, "
                         f"got {tuple(clean.shape)} and {tuple(corrupt.shape)}")
    return clean, corrupt


@torch.no_grad()
def patched_run(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, hook_name: str,
                position: Optional[int] = None, head: Optional[int] = None, return_type: Optional[str] = "logits"):
    """Runs the corrupted tokens with the activation at ``hook_name`` taken from the clean run.

    ``position`` patches one position, ``head`` one head of an ``attn.hook_z``; neither patches all of it.

    Example:
        >>> patched_run(model, clean, corrupt, "blocks.0.hook_resid_pre")   # == model(clean)   # doctest: +SKIP
    """
    clean, corrupt = _pair(model, clean_tokens, corrupt_tokens)
    model.layer_of(hook_name)  # an unknown name is an error naming it
    _, cache = model.run_with_cache(clean, names_filter=lambda name: name == hook_name)
    site, value = Site(hook_name, position, head), cache[hook_name]
    hook = lambda act, hook: site.write(act.clone(), value)
    return model.run_with_hooks(corrupt, return_type=return_type, fwd_hooks=[(hook_name, hook)])


def _exact(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, sites: Sequence[Site],
           labels: pd.DataFrame, progress: ProgressArg, desc: str) -> pd.DataFrame:
    """Scores patching each site; ``labels`` holds the result's identifying columns, one row per site."""
    clean, corrupt = _pair(model, clean_tokens, corrupt_tokens)
    metric = logit_diff_metric(answer_token, wrong_token)
    hook_names = sorted({site.hook_name for site in sites})
    clean_value, _, clean_acts = unedited_run(model, clean, metric, hook_names)
    corrupt_value, corrupt_resid, _ = unedited_run(model, corrupt, metric)
    edits = [Edit(site, clean_acts[site.hook_name]) for site in sites]
    values = score_edits(model, corrupt_resid, corrupt, edits, metric, progress, desc=desc).numpy()
    table = labels.reset_index(drop=True)
    table["metric"] = values
    table["delta"] = values - corrupt_value
    denominator = clean_value - corrupt_value
    table["normalized"] = table["delta"] / denominator if abs(denominator) > 1e-12 else np.nan
    table.attrs.update(clean_metric=clean_value, corrupt_metric=corrupt_value, str_tokens=str_tokens(model, clean[0]))
    return table


def patch_residual(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, answer_token: TokenId,
                   wrong_token: TokenId, progress: ProgressArg = True) -> pd.DataFrame:
    """Patches the residual stream entering each layer at each position: DataFrame[layer, position, metric, delta, normalized].

    Example:
        >>> df = patch_residual(model, clean, corrupt, model.to_single_token(" Mary"), model.to_single_token(" John"))   # doctest: +SKIP
        >>> patching_heatmap(df, "residual stream")                                                               # doctest: +SKIP
    """
    P = model.as_tokens(clean_tokens).shape[1]
    labels = pd.DataFrame([(l, p) for l in range(model.cfg.n_layers) for p in range(P)], columns=["layer", "position"])
    sites = [Site(f"blocks.{l}.hook_resid_pre", position=p) for l, p in labels.itertuples(index=False)]
    return _exact(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, sites, labels, progress,
                  "patch residual")


def patch_attn_mlp(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, answer_token: TokenId,
                   wrong_token: TokenId, progress: ProgressArg = True) -> pd.DataFrame:
    """Patches each layer's attention and MLP output at each position: DataFrame[component, layer, position, metric, delta, normalized].

    Example:
        >>> patching_heatmap(patch_attn_mlp(model, clean, corrupt, answer, wrong), "attention and MLP outputs")   # doctest: +SKIP
    """
    P = model.as_tokens(clean_tokens).shape[1]
    components = ["attn"] + ([] if model.cfg.attn_only else ["mlp"])
    labels = pd.DataFrame([(c, l, p) for c in components for l in range(model.cfg.n_layers) for p in range(P)],
                          columns=["component", "layer", "position"])
    sites = [Site(f"blocks.{l}.hook_{c}_out", position=p) for c, l, p in labels.itertuples(index=False)]
    return _exact(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, sites, labels, progress,
                  "patch attn/mlp")


def patch_heads(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, answer_token: TokenId,
                wrong_token: TokenId, progress: ProgressArg = True) -> pd.DataFrame:
    """Patches each head's output (hook_z, all positions): DataFrame[layer, head, metric, delta, normalized].

    Example:
        >>> patch_heads(model, clean, corrupt, answer, wrong).nlargest(5, "normalized")   # doctest: +SKIP
    """
    labels = pd.DataFrame([(l, h) for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)],
                          columns=["layer", "head"])
    sites = [Site(f"blocks.{l}.attn.hook_z", index=h) for l, h in labels.itertuples(index=False)]
    return _exact(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, sites, labels, progress,
                  "patch heads")


def attribution_patching(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, answer_token: TokenId,
                         wrong_token: TokenId, sites: Sequence[str] = ("resid", "attn", "mlp", "heads")) -> pd.DataFrame:
    """APPROXIMATE patching effects of every site from one clean forward, one corrupted forward and one backward.

    attribution = sum over the site's elements (and the batch) of (clean - corrupt) * d metric /
    d activation, evaluated at the corrupted run: a first-order estimate of exact patching's
    ``delta``. Returns DataFrame[site, layer, position, head, attribution] where site is "resid"
    (hook_resid_pre), "attn", "mlp" (per position; head = -1) or "heads" (hook_z summed over
    positions; position = -1). ``df.attrs["method"]`` says it is an approximation.

    Example:
        >>> approx = attribution_patching(model, clean, corrupt, answer, wrong, sites=["heads"])   # doctest: +SKIP
    """
    unknown = sorted(set(sites) - set(SITES))
    if unknown:
        raise InputError(f"unknown attribution site(s) {unknown}; choose from {sorted(SITES)}")
    sites = [s for s in sites if not (s == "mlp" and model.cfg.attn_only)]
    clean, corrupt = _pair(model, clean_tokens, corrupt_tokens)
    metric = logit_diff_metric(answer_token, wrong_token)
    names = [(site, layer, f"blocks.{layer}.{SITES[site]}") for site in sites for layer in range(model.cfg.n_layers)]
    wanted = {name for _, _, name in names}
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean, names_filter=lambda n: n in wanted)
    saved: dict[str, Tensor] = {}

    def save(activation: Tensor, hook) -> None:
        saved[hook.name] = activation

    def track(embed: Tensor, hook) -> Tensor:  # gradients flow even when the weights are frozen
        return embed if embed.requires_grad else embed.detach().requires_grad_(True)

    with torch.enable_grad():
        logits = model.run_with_hooks(corrupt, fwd_hooks=[("hook_embed", track)] + [(n, save) for n in sorted(wanted)])
        grads = torch.autograd.grad(metric(logits, corrupt), [saved[n] for _, _, n in names], allow_unused=True)
    rows = []
    for (site, layer, name), grad in zip(names, grads):
        diff = (clean_cache[name] - saved[name].detach())
        effect = torch.zeros_like(diff) if grad is None else diff * grad
        if site == "heads":
            for head, value in enumerate(effect.sum((0, 1, 3)).tolist()):
                rows.append((site, layer, -1, head, value))
        else:
            for position, value in enumerate(effect.sum((0, 2)).tolist()):
                rows.append((site, layer, position, -1, value))
    table = pd.DataFrame(rows, columns=["site", "layer", "position", "head", "attribution"])
    table.attrs.update(method="attribution patching (first-order linear approximation of activation patching)",
                       str_tokens=str_tokens(model, clean[0]))
    return table


def compare_attribution_to_exact(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, answer_token: TokenId,
                                 wrong_token: TokenId, progress: ProgressArg = False) -> tuple[pd.DataFrame, float]:
    """Per-head exact patching delta beside its attribution estimate, and their Pearson correlation.

    Example:
        >>> table, r = compare_attribution_to_exact(model, clean, corrupt, answer, wrong)   # doctest: +SKIP
    """
    exact = patch_heads(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, progress)
    approx = attribution_patching(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, sites=["heads"])
    merged = exact.merge(approx[["layer", "head", "attribution"]], on=["layer", "head"])
    r = float(np.corrcoef(merged["delta"], merged["attribution"])[0, 1])
    return merged, r


def patching_heatmap(df: pd.DataFrame, title: str = "", value: Optional[str] = None) -> go.Figure:
    """Heatmap of a patching DataFrame: layer x head, or layer x position (one panel per component/site).

    ``value`` is the column to colour by (default: "normalized" when present, else "metric" or "attribution").

    Example:
        >>> patching_heatmap(patch_residual(model, clean, corrupt, answer, wrong), "residual stream")   # doctest: +SKIP
    """
    value = value or next(c for c in ("normalized", "attribution", "metric") if c in df.columns)
    if value not in df.columns:
        raise InputError(f"column {value!r} not in the DataFrame (columns: {list(df.columns)})")
    group_col = next((c for c in ("component", "site") if c in df.columns), None)
    groups = [(None, df)] if group_col is None else list(df.groupby(group_col, sort=False))
    by_head = "position" not in df.columns or all(g["position"].eq(-1).all() for _, g in groups)
    if by_head and len(groups) == 1:
        grid = df.pivot_table(index="layer", columns="head", values=value)
        return scores_heatmap(torch.tensor(grid.values), title, colorscale="RdBu", zmid=0.0, value_name=value)
    fig = make_subplots(rows=1, cols=len(groups), subplot_titles=[str(name or "") for name, _ in groups],
                        horizontal_spacing=0.08)
    labels = df.attrs.get("str_tokens")
    for i, (name, group) in enumerate(groups):
        column = "head" if group["position"].eq(-1).all() else "position"
        grid = group.pivot_table(index="layer", columns=column, values=value)
        sub = labelled_heatmap(grid.values, [(axis_labels(labels)[c] if labels and column == "position" else str(c))
                                             for c in grid.columns],
                               [str(l) for l in grid.index], colorscale="RdBu", zmid=0.0,
                               x_title=column, y_title="layer", value_name=value)
        trace = sub.data[0]
        trace.coloraxis = "coloraxis"
        fig.add_trace(trace, row=1, col=i + 1)
        fig.update_xaxes(tickmode="array", tickvals=list(range(len(grid.columns))),
                         ticktext=sub.layout.xaxis.ticktext, row=1, col=i + 1)
        fig.update_yaxes(autorange="reversed", title_text="layer" if i == 0 else None, row=1, col=i + 1)
    fig.update_layout(title=title, coloraxis=dict(colorscale="RdBu", cmid=0.0, colorbar=dict(title=value)),
                      height=max(400, 20 * df["layer"].nunique() + 200), width=max(600, 500 * len(groups)))
    return fig


def main(argv: Optional[Sequence[str]] = None) -> None:
    from experiments import _cli

    parser = _cli.make_parser("Activation patching (residual, attention/MLP, heads) and attribution patching.")
    parser.add_argument("--clean", default="When Mary and John went to the store, John gave a drink to")
    parser.add_argument("--corrupt", default="When Mary and John went to the store, Mary gave a drink to")
    parser.add_argument("--answer", default=" Mary")
    parser.add_argument("--wrong", default=" John")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    if model.tokenizer is None:
        raise SystemExit("patching from text needs a model with a tokenizer")
    clean, corrupt = model.to_tokens(args.clean), model.to_tokens(args.corrupt)
    answer, wrong = model.to_single_token(args.answer), model.to_single_token(args.wrong)
    progress = not args.no_progress
    summary = {"model": args.model, "clean": args.clean, "corrupt": args.corrupt, "answer": args.answer, "wrong": args.wrong}
    resid = patch_residual(model, clean, corrupt, answer, wrong, progress)
    _cli.write_outputs(args.out, "patch_residual", resid, patching_heatmap(resid, "Residual stream patching"),
                       {"experiment": "patch_residual", **summary, **resid.attrs})
    layers = patch_attn_mlp(model, clean, corrupt, answer, wrong, progress)
    _cli.write_outputs(args.out, "patch_attn_mlp", layers, patching_heatmap(layers, "Attention / MLP output patching"),
                       {"experiment": "patch_attn_mlp", **summary, **layers.attrs})
    heads, r = compare_attribution_to_exact(model, clean, corrupt, answer, wrong, progress)
    _cli.write_outputs(args.out, "patch_heads", heads, patching_heatmap(heads, "Head patching (exact)"),
                       {"experiment": "patch_heads", **summary, **heads.attrs,
                        "attribution_vs_exact_pearson_r": r,
                        "note": "attribution column: first-order linear approximation of delta"})


if __name__ == "__main__":
    from experiments._cli import run_main

    run_main(main)
