"""Activation patching from a clean run into a corrupted one, exact and by attribution.

Legend: B batch, P position, L n_layers, H n_heads, K d_head, D d_model, V d_vocab.

The metric is the logit difference logit[answer] - logit[wrong] at each prompt's last real
token, or any ``experiments.metrics`` metric or callable; values are means over the prompts
(``per_prompt=True`` keeps each prompt's). Clean and corrupted prompts of different lengths pad
to one width, each run under its own attention mask. Exact patching replaces one activation of the corrupted run by the clean run's
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
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots
from torch import Tensor

from experiments._batched import Edit, score_edits, unedited_run
from experiments._progress import ProgressArg
from experiments._tokens import TokensLike, axis_labels, str_tokens
from experiments.metrics import (LogitDiff, Metric, MetricLike, PositionSelector, PromptBatch, TokenIds, as_metric, logit_diff,
                                 per_prompt_table, prompt_batch, require_per_prompt_values)
from experiments.figures import labelled_heatmap, scores_heatmap
from experiments.sites import Site
from workbench.errors import InputError

SITES = {"resid": "hook_resid_pre", "attn": "hook_attn_out", "mlp": "hook_mlp_out", "heads": "attn.hook_z"}


def logit_diff_metric(answer_token: TokenIds, wrong_token: TokenIds, position: PositionSelector = "last") -> LogitDiff:
    """metric(logits [B, P, V], tokens) = mean over b of logits[b, pos_b, answer_b] - logits[b, pos_b, wrong_b].

    ``position`` is "last" (each row's last real token: the mask tells), an int, or one per row.

    Example:
        >>> logit_diff_metric(2, 0)(torch.tensor([[[1.0, 0.0, 3.0]]]), None).item()
        2.0
    """
    ids = [torch.as_tensor(token).reshape(-1).long() for token in (answer_token, wrong_token)]
    return LogitDiff(ids[0], ids[1], position)


def patch_pair(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, clean_mask: Optional[Tensor] = None,
               corrupt_mask: Optional[Tensor] = None, padding_side: str = "right") -> tuple[PromptBatch, PromptBatch]:
    """Clean and corrupted prompts aligned by padding to one width, each with its own mask.

    Lists of texts are tokenized together; token tensors of different widths are padded on
    ``padding_side``. Position p of a clean row is patched into position p of its corrupted row.

    Example:
        >>> clean, corrupt = patch_pair(model, ["When Mary and John went", "A B"], ["When Mary and Sam went", "A C"])   # doctest: +SKIP
    """
    if _is_text_list(clean_tokens) and _is_text_list(corrupt_tokens) and len(clean_tokens) == len(corrupt_tokens):
        tokens, mask = model.to_tokens_and_mask(list(clean_tokens) + list(corrupt_tokens), padding_side=padding_side)
        n = len(clean_tokens)
        clean_tokens, corrupt_tokens, clean_mask, corrupt_mask = tokens[:n], tokens[n:], mask[:n], mask[n:]
    clean = prompt_batch(model, clean_tokens, clean_mask, padding_side)
    corrupt = prompt_batch(model, corrupt_tokens, corrupt_mask, padding_side)
    if clean.size != corrupt.size:
        raise InputError(f"there are {clean.size} clean prompts but {corrupt.size} corrupted ones; pair each clean "
                         f"prompt with one corrupted prompt")
    width = max(clean.tokens.shape[1], corrupt.tokens.shape[1])
    return _pad_to(model, clean, width, padding_side), _pad_to(model, corrupt, width, padding_side)


def _is_text_list(tokens: TokensLike) -> bool:
    return isinstance(tokens, (list, tuple)) and bool(tokens) and all(isinstance(t, str) for t in tokens)


def _pad_to(model, batch: PromptBatch, width: int, side: str) -> PromptBatch:
    """``batch`` padded with pad tokens (masked out) to ``width`` positions on ``side``."""
    B, P = batch.tokens.shape
    if P == width:
        return batch
    if side not in ("right", "left"):
        raise InputError(f"padding_side must be 'right' or 'left', got {side!r}")
    pad_id = model.tokenizer.pad_token_id if model.tokenizer is not None else None
    pad = torch.full((B, width - P), 0 if pad_id is None else pad_id, dtype=batch.tokens.dtype, device=batch.tokens.device)
    mask = batch.mask if batch.mask is not None else torch.ones(B, P, dtype=torch.bool, device=batch.tokens.device)
    parts = [(batch.tokens, mask), (pad, torch.zeros_like(pad, dtype=torch.bool))]
    if side == "left":
        parts.reverse()
    return PromptBatch(torch.cat([parts[0][0], parts[1][0]], 1), torch.cat([parts[0][1], parts[1][1]], 1))


def _patching_metric(model, rows: int, answer_token: Optional[TokenIds], wrong_token: Optional[TokenIds],
                    metric: Optional[MetricLike], position: Optional[PositionSelector]) -> Metric:
    """The metric a patching run scores: ``metric`` when given, else the logit difference of answer over wrong.

    Example:
        >>> _patching_metric(model, 2, " Mary", " John", None, None)   # LogitDiff at each row's last token   # doctest: +SKIP
    """
    if metric is not None:
        return as_metric(metric, position)
    if answer_token is None or wrong_token is None:
        raise InputError("patching needs answer_token and wrong_token (for the logit difference) or a metric=")
    return logit_diff(model, answer_token, wrong_token, rows, "last" if position is None else position)


@torch.no_grad()
def patched_run(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, hook_name: str,
                position: Optional[int] = None, head: Optional[int] = None, return_type: Optional[str] = "logits",
                clean_mask: Optional[Tensor] = None, corrupt_mask: Optional[Tensor] = None):
    """Runs the corrupted tokens with the activation at ``hook_name`` taken from the clean run.

    ``position`` patches one position, ``head`` one head of an ``attn.hook_z``; neither patches all of it.

    Example:
        >>> patched_run(model, clean, corrupt, "blocks.0.hook_resid_pre")   # == model(clean)   # doctest: +SKIP
    """
    clean, corrupt = patch_pair(model, clean_tokens, corrupt_tokens, clean_mask, corrupt_mask)
    model.layer_of(hook_name)  # an unknown name is an error naming it
    _, cache = model.run_with_cache(clean.tokens, attention_mask=clean.mask, names_filter=lambda name: name == hook_name)
    site, value = Site(hook_name, position, head), cache[hook_name]
    hook = lambda act, hook: site.write(act.clone(), value)
    return model.run_with_hooks(corrupt.tokens, attention_mask=corrupt.mask, return_type=return_type,
                                fwd_hooks=[(hook_name, hook)])


@dataclass(frozen=True)
class PatchingRun:
    """What every exact patching function takes besides its sites: the prompts, the metric and how to report."""

    clean: PromptBatch
    corrupt: PromptBatch
    metric: Metric
    per_prompt: bool
    progress: ProgressArg


def _patching_run(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, progress, metric, position,
                  per_prompt, clean_mask, corrupt_mask, padding_side) -> PatchingRun:
    clean, corrupt = patch_pair(model, clean_tokens, corrupt_tokens, clean_mask, corrupt_mask, padding_side)
    return PatchingRun(clean, corrupt, _patching_metric(model, clean.size, answer_token, wrong_token, metric, position),
                       per_prompt, progress)


def _exact(model, run: PatchingRun, sites: Sequence[Site], labels: pd.DataFrame, desc: str) -> pd.DataFrame:
    """Scores patching each site; ``labels`` holds the result's identifying columns, one row per site."""
    hook_names = sorted({site.hook_name for site in sites})
    clean_R, _, clean_acts = unedited_run(model, run.clean, run.metric, hook_names)
    corrupt_R, corrupt_resid, _ = unedited_run(model, run.corrupt, run.metric)
    edits = [Edit(site, clean_acts[site.hook_name]) for site in sites]
    values_nR = score_edits(model, corrupt_resid, run.corrupt, edits, run.metric, run.progress, desc=desc)
    labels = labels.reset_index(drop=True)
    if run.per_prompt:
        table = per_prompt_table(labels, values_nR, run.clean.size, "patching")
        clean_value, corrupt_value = clean_R.numpy()[table["prompt"]], corrupt_R.numpy()[table["prompt"]]
    else:
        table = labels.assign(metric=values_nR.mean(1).numpy())
        clean_value, corrupt_value = float(clean_R.mean()), float(corrupt_R.mean())
    table["delta"] = table["metric"] - corrupt_value
    denominator = np.asarray(clean_value - corrupt_value, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        table["normalized"] = np.where(np.abs(denominator) > 1e-12, table["delta"] / denominator, np.nan)
    table.attrs.update(clean_metric=float(clean_R.mean()), corrupt_metric=float(corrupt_R.mean()),
                       clean_metric_per_prompt=clean_R.tolist(), corrupt_metric_per_prompt=corrupt_R.tolist(),
                       str_tokens=str_tokens(model, run.clean.tokens[0]))
    return table


_RUN_DOC = """``answer_token`` / ``wrong_token``: one id or text, or one per prompt (the logit difference at
    each row's last real token); or pass ``metric=`` (``LogitDiff``, ``TokenProbability``, "loss" or a
    callable over logits) with a ``position`` selector. Values are means over prompts;
    ``per_prompt=True`` returns a ``prompt`` column instead. Prompts of different lengths pad to one
    width (lists of texts do it themselves; tensors take ``clean_mask`` / ``corrupt_mask``)."""


def patch_residual(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, answer_token: Optional[TokenIds] = None,
                   wrong_token: Optional[TokenIds] = None, progress: ProgressArg = True, *,
                   metric: Optional[MetricLike] = None, position: Optional[PositionSelector] = None,
                   per_prompt: bool = False, clean_mask: Optional[Tensor] = None,
                   corrupt_mask: Optional[Tensor] = None, padding_side: str = "right") -> pd.DataFrame:
    """Patches the residual stream entering each layer at each position: DataFrame[layer, position, metric, delta, normalized].

    {run}

    Example:
        >>> df = patch_residual(model, clean, corrupt, " Mary", " John")   # doctest: +SKIP
        >>> patching_heatmap(df, "residual stream")                       # doctest: +SKIP
    """
    run = _patching_run(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, progress, metric, position,
                        per_prompt, clean_mask, corrupt_mask, padding_side)
    P = run.clean.tokens.shape[1]
    labels = pd.DataFrame([(l, p) for l in range(model.cfg.n_layers) for p in range(P)], columns=["layer", "position"])
    sites = [Site(f"blocks.{l}.hook_resid_pre", position=p) for l, p in labels.itertuples(index=False)]
    return _exact(model, run, sites, labels, "patch residual")


def patch_attn_mlp(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, answer_token: Optional[TokenIds] = None,
                   wrong_token: Optional[TokenIds] = None, progress: ProgressArg = True, *,
                   metric: Optional[MetricLike] = None, position: Optional[PositionSelector] = None,
                   per_prompt: bool = False, clean_mask: Optional[Tensor] = None,
                   corrupt_mask: Optional[Tensor] = None, padding_side: str = "right") -> pd.DataFrame:
    """Patches each layer's attention and MLP output at each position: DataFrame[component, layer, position, metric, delta, normalized].

    {run}

    Example:
        >>> patching_heatmap(patch_attn_mlp(model, clean, corrupt, answer, wrong), "attention and MLP outputs")   # doctest: +SKIP
    """
    run = _patching_run(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, progress, metric, position,
                        per_prompt, clean_mask, corrupt_mask, padding_side)
    P = run.clean.tokens.shape[1]
    components = ["attn"] + ([] if model.cfg.attn_only else ["mlp"])
    labels = pd.DataFrame([(c, l, p) for c in components for l in range(model.cfg.n_layers) for p in range(P)],
                          columns=["component", "layer", "position"])
    sites = [Site(f"blocks.{l}.hook_{c}_out", position=p) for c, l, p in labels.itertuples(index=False)]
    return _exact(model, run, sites, labels, "patch attn/mlp")


def patch_heads(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, answer_token: Optional[TokenIds] = None,
                wrong_token: Optional[TokenIds] = None, progress: ProgressArg = True, *,
                metric: Optional[MetricLike] = None, position: Optional[PositionSelector] = None,
                per_prompt: bool = False, clean_mask: Optional[Tensor] = None,
                corrupt_mask: Optional[Tensor] = None, padding_side: str = "right") -> pd.DataFrame:
    """Patches each head's output (hook_z, all positions): DataFrame[layer, head, metric, delta, normalized].

    {run}

    Example:
        >>> patch_heads(model, clean, corrupt, answer, wrong).nlargest(5, "normalized")   # doctest: +SKIP
    """
    run = _patching_run(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, progress, metric, position,
                        per_prompt, clean_mask, corrupt_mask, padding_side)
    labels = pd.DataFrame([(l, h) for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)],
                          columns=["layer", "head"])
    sites = [Site(f"blocks.{l}.attn.hook_z", index=h) for l, h in labels.itertuples(index=False)]
    return _exact(model, run, sites, labels, "patch heads")


for _function in (patch_residual, patch_attn_mlp, patch_heads):
    _function.__doc__ = _function.__doc__.replace("{run}", _RUN_DOC)


def attribution_patching(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike,
                         answer_token: Optional[TokenIds] = None, wrong_token: Optional[TokenIds] = None,
                         sites: Sequence[str] = ("resid", "attn", "mlp", "heads"), *,
                         metric: Optional[MetricLike] = None, position: Optional[PositionSelector] = None,
                         per_prompt: bool = False, clean_mask: Optional[Tensor] = None,
                         corrupt_mask: Optional[Tensor] = None, padding_side: str = "right") -> pd.DataFrame:
    """APPROXIMATE patching effects of every site from one clean forward, one corrupted forward and one backward.

    attribution = sum over the site's elements of (clean - corrupt) * d metric / d activation,
    evaluated at the corrupted run, averaged over prompts: a first-order estimate of exact
    patching's ``delta``. Returns DataFrame[site, layer, position, head, attribution] where site is
    "resid" (hook_resid_pre), "attn", "mlp" (per position; head = -1) or "heads" (hook_z summed over
    positions; position = -1), with a ``prompt`` column under ``per_prompt=True``.
    ``df.attrs["method"]`` says it is an approximation; ``clean_metric`` / ``corrupt_metric`` (and their
    ``_per_prompt`` lists) hold the metric of the two unpatched runs. Arguments as ``patch_heads``.

    Example:
        >>> approx = attribution_patching(model, clean, corrupt, answer, wrong, sites=["heads"])   # doctest: +SKIP
    """
    unknown = sorted(set(sites) - set(SITES))
    if unknown:
        raise InputError(f"unknown attribution site(s) {unknown}; choose from {sorted(SITES)}")
    sites = [s for s in sites if not (s == "mlp" and model.cfg.attn_only)]
    run = _patching_run(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, False, metric, position,
                        per_prompt, clean_mask, corrupt_mask, padding_side)
    names = [(site, layer, f"blocks.{layer}.{SITES[site]}") for site in sites for layer in range(model.cfg.n_layers)]
    wanted = {name for _, _, name in names}
    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(run.clean.tokens, attention_mask=run.clean.mask,
                                                         names_filter=lambda n: n in wanted)
        clean_R = run.metric.values(clean_logits, run.clean).float().cpu()
    saved: dict[str, Tensor] = {}

    def save(activation: Tensor, hook) -> None:
        saved[hook.name] = activation

    def track(embed: Tensor, hook) -> Tensor:  # gradients flow even when the weights are frozen
        return embed if embed.requires_grad else embed.detach().requires_grad_(True)

    with torch.enable_grad():
        logits = model.run_with_hooks(run.corrupt.tokens, attention_mask=run.corrupt.mask,
                                      fwd_hooks=[("hook_embed", track)] + [(n, save) for n in sorted(wanted)])
        values_R = run.metric.values(logits, run.corrupt)
        if per_prompt:
            require_per_prompt_values(len(values_R), run.corrupt.size, "attribution")
        grads = torch.autograd.grad(values_R.mean(), [saved[n] for _, _, n in names], allow_unused=True)
    frames = []
    for (site, layer, name), grad in zip(names, grads):
        diff = clean_cache[name] - saved[name].detach()
        effect = torch.zeros_like(diff) if grad is None else diff * grad
        if site == "heads":  # [B, P, H, K] -> [B, H]
            by_B_ = effect.sum((1, 3))
            index = {"position": -1, "head": np.arange(by_B_.shape[1])}
        else:  # [B, P, D] -> [B, P]
            by_B_ = effect.sum(2)
            index = {"position": np.arange(by_B_.shape[1]), "head": -1}
        frame = pd.DataFrame({"site": site, "layer": layer, **index})
        if per_prompt:  # the mean's gradient is 1/B of each prompt's: scale back to each prompt's own
            frame = per_prompt_table(frame, (by_B_ * by_B_.shape[0]).T.float().cpu(), run.corrupt.size, "attribution")
            frame = frame.rename(columns={"metric": "attribution"})
        else:
            frame["attribution"] = by_B_.sum(0).float().cpu().numpy()
        frames.append(frame)
    table = pd.concat(frames, ignore_index=True)[["site", "layer", "position", "head"] + (["prompt"] if per_prompt else [])
                                                + ["attribution"]]
    corrupt_R = values_R.detach().float().cpu()
    table.attrs.update(method="attribution patching (first-order linear approximation of activation patching)",
                       str_tokens=str_tokens(model, run.clean.tokens[0]), clean_metric=float(clean_R.mean()),
                       corrupt_metric=float(corrupt_R.mean()), clean_metric_per_prompt=clean_R.tolist(),
                       corrupt_metric_per_prompt=corrupt_R.tolist())
    return table


def compare_attribution_to_exact(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike,
                                 answer_token: Optional[TokenIds] = None, wrong_token: Optional[TokenIds] = None,
                                 progress: ProgressArg = False, **options) -> tuple[pd.DataFrame, float]:
    """Per-head exact patching delta beside its attribution estimate, and their Pearson correlation.

    ``options``: ``metric``, ``position``, ``clean_mask``, ``corrupt_mask``, ``padding_side`` as ``patch_heads``.

    Example:
        >>> table, r = compare_attribution_to_exact(model, clean, corrupt, answer, wrong)   # doctest: +SKIP
    """
    exact = patch_heads(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, progress, **options)
    approx = attribution_patching(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, sites=["heads"],
                                  **options)
    merged = exact.merge(approx[["layer", "head", "attribution"]], on=["layer", "head"])
    merged.attrs.update(exact.attrs)
    return merged, attribution_agreement(exact, approx)["pearson_r"]


# A site counts towards the sign agreement when its exact effect is at least this share of the largest:
# sites that patching leaves (nearly) unchanged have no meaningful sign.
SIGN_FLOOR = 0.01


def attribution_agreement(exact: pd.DataFrame, approx: pd.DataFrame) -> dict[str, float]:
    """How well attribution patching estimates exact patching: Pearson r of ``delta`` against ``attribution``
    over the matching sites, and the share of sites where the two have the same sign.

    ``exact`` is a ``patch_residual``, ``patch_attn_mlp`` or ``patch_heads`` table (means over prompts);
    ``approx`` an ``attribution_patching`` table, whose rows of the matching site ("resid", "attn"/"mlp"
    or "heads") are used. The sign agreement counts the sites whose exact ``|delta|`` is at least
    ``SIGN_FLOOR`` of the largest (the others barely move the metric). Returns {"pearson_r",
    "sign_agreement", "sites", "signed_sites"}; r is NaN when either column is constant.

    Example:
        >>> exact = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 1, 0], "delta": [1.0, -2.0, 0.001]})
        >>> approx = pd.DataFrame({"site": "heads", "layer": [0, 0, 1], "position": -1, "head": [0, 1, 0],
        ...                        "attribution": [0.5, -1.5, -0.1]})
        >>> {k: round(v, 3) for k, v in attribution_agreement(exact, approx).items()}
        {'pearson_r': 0.999, 'sign_agreement': 1.0, 'sites': 3, 'signed_sites': 2}
    """
    if "component" in exact.columns:
        exact, sites = exact.rename(columns={"component": "site"}), set(exact["component"])
    else:
        sites = {"heads" if "head" in exact.columns else "resid"}
    approx = approx[approx["site"].isin(sites)] if "site" in approx.columns else approx
    keys = [c for c in ("site", "layer", "position", "head") if c in exact.columns and c in approx.columns]
    merged = exact[keys + ["delta"]].merge(approx[keys + ["attribution"]], on=keys)
    if merged.empty:
        raise InputError(f"the exact and attribution tables share no site (keys {keys}, exact sites {sorted(sites)})")
    delta, attribution = merged["delta"].to_numpy(float), merged["attribution"].to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = float(np.corrcoef(delta, attribution)[0, 1]) if len(merged) > 1 else float("nan")
    signed = np.abs(delta) >= SIGN_FLOOR * np.abs(delta).max() if np.abs(delta).max() > 0 else np.zeros_like(delta, bool)
    agree = float((np.sign(delta[signed]) == np.sign(attribution[signed])).mean()) if signed.any() else float("nan")
    return {"pearson_r": r, "sign_agreement": agree, "sites": int(len(merged)), "signed_sites": int(signed.sum())}


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


def head_map_figure(df: pd.DataFrame, title: str = "", value: Optional[str] = None) -> go.Figure:
    """``patching_heatmap`` of a layer x head table with a click target on every cell.

    Plotly reports no click on a heatmap cell to Streamlit (streamlit/streamlit#8760), so an
    invisible marker sits on each cell; a click selects it, and its ``customdata`` is [layer, head].
    The markers carry the hover text, so the heatmap's own hover is switched off.

    Example:
        >>> df = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "delta": [0.1, -0.2, 0.3, 0.0]})
        >>> fig = head_map_figure(df, "heads", value="delta")
        >>> fig.data[1].customdata[:2], fig.data[1].marker.opacity
        (([0, 0, 0.1], [0, 1, -0.2]), 0)
    """
    if "head" not in df.columns or ("position" in df.columns and not df["position"].eq(-1).all()):
        raise InputError("head_map_figure draws a layer x head table (patch_heads, or attribution rows of site 'heads')")
    value = value or next(c for c in ("normalized", "attribution", "metric") if c in df.columns)
    cells = df.sort_values(["layer", "head"])
    fig = patching_heatmap(cells[["layer", "head", value]], title, value)
    fig.update_traces(hoverinfo="skip", hovertemplate=None, selector=dict(type="heatmap"))
    fig.add_trace(go.Scatter(
        x=cells["head"], y=cells["layer"], mode="markers", showlegend=False,
        marker=dict(symbol="square", size=14, opacity=0),
        customdata=[[int(l), int(h), float(v)] for l, h, v in zip(cells["layer"], cells["head"], cells[value])],
        hovertemplate="L%{customdata[0]}H%{customdata[1]}<br>" + value + "=%{customdata[2]:.4f}<extra></extra>"))
    # Fixed ranges: the markers must not widen the axes, so cell (layer, head) stays where the heatmap draws it.
    fig.update_xaxes(range=[-0.5, cells["head"].max() + 0.5])
    fig.update_yaxes(range=[cells["layer"].max() + 0.5, -0.5], autorange=False)
    fig.update_layout(clickmode="event+select", hoverdistance=-1)
    return fig


def main(argv: Optional[Sequence[str]] = None) -> None:
    from experiments import _cli

    parser = _cli.make_parser("Activation patching (residual, attention/MLP, heads) and attribution patching.", "patching")
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
