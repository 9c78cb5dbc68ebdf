"""Logit lens and direct logit attribution, of one prompt or averaged over a padded batch.

Legend: B batch, L n_layers, P position, H n_heads, K d_head, D d_model, V d_vocab, T residual snapshots.

Logit lens: the residual stream entering each layer (and the final one) is read out through
the model's own final norm and unembedding (``Decoder.logits_from_resid``), so snapshot L is
exactly the model's logits. ``logit_lens`` shows one prompt's top tokens (``row`` of a padded
batch, its pads dropped); ``logit_lens_metric`` reads a dataset-level metric (e.g. ``LogitDiff`` at
each prompt's last real token) through every snapshot, as the mean over prompts or per prompt.

Direct logit attribution (pre-norm models): the final residual is a sum of components
(embeddings, each head's output, each attention bias, each MLP output). With the final norm's
scale frozen at its value on this input, the norm is linear (``Decoder.apply_final_norm`` with
``frozen_scale``), so each component's share of logit[target] - logit[baseline] is
norm(component) . (W_U[target] - W_U[baseline]); a LayerNorm bias adds one more term. The shares sum exactly to the logit difference.
Over a batch each prompt is read at its own position (its last real token by default) with its
own target and baseline, and the shares are averaged over prompts (they sum to the mean logit difference).

Padded batches take ``attention_mask`` [B, P] (1 real, 0 pad; a list of texts builds it, padded on
``padding_side``); each row's values equal its prompt run alone, and a batch's value is the mean
of its prompts' values.

``python -m experiments.lens --model NAME --out DIR [--prompt TEXT --target TEXT --baseline TEXT]``
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Float, Int
from plotly.subplots import make_subplots
from torch import Tensor

from experiments._batched import metric_from_final_resid
from experiments._tokens import TokensLike, axis_labels, str_tokens
from experiments.figures import labelled_heatmap
from experiments.metrics import (MetricLike, PositionSelector, TokenIds, as_metric, per_prompt_table, prompt_batch,
                                 token_ids)
from workbench.errors import InputError

LOGITS_BYTES_PER_CHUNK = 2**28


def _prompt_alone(model, tokens: TokensLike, row: int, attention_mask: Optional[Tensor],
                  padding_side: str) -> Int[Tensor, "1 pos"]:
    """Prompt ``row`` of a (padded) batch as its real tokens only, [1, n]: run alone, it gives that row's values."""
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    if not -batch.size <= row < batch.size:
        raise InputError(f"row={row} is outside the batch of {batch.size} prompt(s)")
    tokens_P = batch.tokens[row]
    return (tokens_P if batch.mask is None else tokens_P[batch.mask[row]])[None]


@torch.no_grad()
def residual_snapshots(model, tokens: TokensLike, row: int = 0, *, attention_mask: Optional[Tensor] = None,
                       padding_side: str = "right") -> Float[Tensor, "snapshots pos d_model"]:
    """The residual stream of prompt ``row`` entering each layer, then after the last: [L + 1, P, D].

    A padded batch takes ``attention_mask`` (a list of texts builds it); the row's pads are
    dropped (P is its real tokens), so it equals the prompt alone.

    Example:
        >>> residual_snapshots(model, tokens).shape   # doctest: +SKIP
        torch.Size([31, 12, 576])
        >>> residual_snapshots(model, ["a b c", "a"], row=1).shape   # BOS and "a"   # doctest: +SKIP
        torch.Size([31, 2, 576])
    """
    tokens_1P = _prompt_alone(model, tokens, row, attention_mask, padding_side)
    L = model.cfg.n_layers
    names = [f"blocks.{l}.hook_resid_pre" for l in range(L)] + [f"blocks.{L - 1}.hook_resid_post"]
    _, cache = model.run_with_cache(tokens_1P, stop_at_layer=L, names_filter=lambda n: n in names)
    return torch.cat([cache[name] for name in names])


@torch.no_grad()
def logit_lens_logits(model, tokens: TokensLike, row: int = 0, *, attention_mask: Optional[Tensor] = None,
                      padding_side: str = "right") -> Float[Tensor, "snapshots pos d_vocab"]:
    """Every snapshot of prompt ``row`` through the final norm and unembedding: [L + 1, P, V]; the last is the model's logits.

    Arguments as ``residual_snapshots`` (a padded row's pads dropped).

    Example:
        >>> torch.allclose(logit_lens_logits(model, tokens)[-1], model(tokens)[0])   # doctest: +SKIP
        True
    """
    return model.logits_from_resid(residual_snapshots(model, tokens, row, attention_mask=attention_mask,
                                                      padding_side=padding_side))


@torch.no_grad()
def logit_lens(model, tokens: TokensLike, top_k: int = 5, row: int = 0, *, attention_mask: Optional[Tensor] = None,
               padding_side: str = "right") -> pd.DataFrame:
    """Top-k tokens of each layer's residual stream at each position of prompt ``row``.

    Returns DataFrame[layer, position, rank, token, token_id, prob]; layer l < n_layers is the
    stream entering block l, layer n_layers the final stream (the model's own prediction). A padded
    batch takes ``attention_mask``; positions are the row's real tokens (its pads dropped).

    Example:
        >>> df = logit_lens(model, model.to_tokens("The Eiffel Tower is in the city of"))   # doctest: +SKIP
        >>> df[(df["rank"] == 1) & (df.position == df.position.max())]                      # doctest: +SKIP
    """
    if top_k < 1:
        raise InputError(f"top_k must be at least 1, got {top_k}")
    resid_TPD = residual_snapshots(model, tokens, row, attention_mask=attention_mask, padding_side=padding_side)
    T, P, _ = resid_TPD.shape
    per_chunk = max(1, LOGITS_BYTES_PER_CHUNK // (4 * P * model.cfg.d_vocab))
    probs, ids = [], []
    for start in range(0, T, per_chunk):
        logits = model.logits_from_resid(resid_TPD[start:start + per_chunk])
        p, i = logits.float().softmax(-1).topk(min(top_k, model.cfg.d_vocab), dim=-1)
        probs.append(p.cpu())
        ids.append(i.cpu())
    probs_TPk, ids_TPk = torch.cat(probs), torch.cat(ids)
    k = ids_TPk.shape[-1]
    flat_ids = ids_TPk.reshape(-1)
    unique, inverse = flat_ids.unique(return_inverse=True)
    text = np.array(str_tokens(model, unique), dtype=object)[inverse.numpy()]
    return pd.DataFrame({
        "layer": np.repeat(np.arange(T), P * k), "position": np.tile(np.repeat(np.arange(P), k), T),
        "rank": np.tile(np.arange(1, k + 1), T * P), "token": text, "token_id": flat_ids.numpy(),
        "prob": probs_TPk.reshape(-1).numpy(),
    })


def _row_labels(str_toks: Sequence, row: int, attention_mask: Optional[Tensor]) -> list[str]:
    """One prompt's token labels from one list or one list per prompt, its pads dropped under ``attention_mask``."""
    labels = list(str_toks)
    if labels and isinstance(labels[0], (list, tuple)):  # one list per prompt
        if not -len(labels) <= row < len(labels):
            raise InputError(f"row={row} is outside the {len(labels)} prompts of str_toks")
        labels = list(labels[row])
    if attention_mask is None:
        return labels
    mask = torch.as_tensor(attention_mask)
    mask = mask if mask.ndim == 1 else mask[row]
    if len(mask) != len(labels):
        raise InputError(f"attention_mask has {len(mask)} positions but str_toks {len(labels)}; they must match")
    return [label for label, real in zip(labels, mask.bool().tolist()) if real]


def logit_lens_figure(df: pd.DataFrame, str_toks: Optional[Sequence] = None, row: int = 0,
                      attention_mask: Optional[Tensor] = None) -> go.Figure:
    """Layer x position grid of each snapshot's top-1 token, coloured by its probability.

    ``str_toks``: the prompt's token labels, or one list per prompt of a padded batch (``row``
    picks one); with ``attention_mask`` ([P] or [B, P]) the row's pad labels are dropped, as
    ``logit_lens`` dropped its pad positions.

    Example:
        >>> logit_lens_figure(logit_lens(model, tokens), model.to_str_tokens(tokens))   # doctest: +SKIP
        >>> logit_lens_figure(logit_lens(model, toks, row=1, attention_mask=mask), model.to_str_tokens(toks), 1, mask)   # doctest: +SKIP
    """
    top = df[df["rank"] == 1]
    prob = top.pivot(index="layer", columns="position", values="prob")
    token = top.pivot(index="layer", columns="position", values="token")
    n_layers = int(top["layer"].max())
    y_labels = [f"resid_pre {l}" if l < n_layers else "final" for l in prob.index]
    if str_toks is not None:
        labels = _row_labels(str_toks, row, attention_mask)
        if len(labels) != prob.shape[1]:
            raise InputError(f"str_toks has {len(labels)} tokens but the logit lens {prob.shape[1]} positions; pass the "
                             f"row's tokens (and attention_mask to drop its pads)")
        x_labels = axis_labels(labels)
    else:
        x_labels = [str(p) for p in prob.columns]
    text = [[str(t)[:10] for t in row_tokens] for row_tokens in token.values]
    fig = labelled_heatmap(prob.values, x_labels, y_labels, title="Logit lens: top token per layer and position",
                           x_title="position", y_title="layer", value_name="prob", text=text, colorscale="Blues")
    fig.update_traces(zmin=0, zmax=1, textfont=dict(size=9))
    fig.update_layout(height=max(400, 22 * len(y_labels) + 150), width=max(600, 70 * len(x_labels) + 200))
    return fig


@torch.no_grad()
def logit_lens_metric(model, tokens: TokensLike, metric: MetricLike, *, position: Optional[PositionSelector] = None,
                      per_prompt: bool = False, attention_mask: Optional[Tensor] = None,
                      padding_side: str = "right") -> pd.DataFrame:
    """A metric read through the final norm and unembedding from every snapshot: DataFrame[layer, metric].

    The logit lens of a dataset-level metric: ``metric`` (``LogitDiff``, ``TokenProbability``, "loss"
    or a callable ``(logits, tokens) -> scalar or [batch]``; see ``experiments.metrics``) evaluated
    on the residual stream entering each layer (layer l) and after the last (layer n_layers, equal
    to the metric of the model's own logits). ``position`` replaces the metric's selector ("last":
    each row's last real token). Means over prompts; ``per_prompt=True`` gives a ``prompt``
    column. A metric at one position per row unembeds only those positions ([B, D] per snapshot);
    the loss is tiled; only a metric over "all" positions unembeds every position. Snapshots are
    scored as the forward pass reaches them, so no cache of every layer is held.

    Example:
        >>> data = ioi_dataset(model, 32)                                                   # doctest: +SKIP
        >>> metric = LogitDiff(data.answer_tokens, data.wrong_tokens)                       # doctest: +SKIP
        >>> logit_lens_metric(model, data.clean_tokens, metric, attention_mask=data.clean_mask)   # doctest: +SKIP
    """
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    metric = as_metric(metric, position)
    L = model.cfg.n_layers
    names = [f"blocks.{l}.hook_resid_pre" for l in range(L)] + [f"blocks.{L - 1}.hook_resid_post"]
    values: dict[str, Tensor] = {}

    def score(resid_BPD: Tensor, hook) -> None:
        values[hook.name] = metric_from_final_resid(model, resid_BPD, batch, metric)[0].float().cpu()

    # stop_at_layer=n_layers: the blocks run and the model does not unembed every position itself.
    model.run_with_hooks(batch.tokens, attention_mask=batch.mask, stop_at_layer=L,
                         fwd_hooks=[(name, score) for name in names])
    values_TR = torch.stack([values[name] for name in names])
    labels = pd.DataFrame({"layer": np.arange(L + 1)})
    if per_prompt:
        table = per_prompt_table(labels, values_TR, batch.size, "logit lens")
    else:
        table = labels.assign(metric=values_TR.mean(1).numpy())
    table.attrs.update(snapshots=names, metric_per_prompt=values_TR.tolist())
    return table


def promoted_and_suppressed(model, effect_V: Float[Tensor, "d_vocab"], k: int = 10) -> pd.DataFrame:
    """The ``k`` tokens a direct effect on the logits raises most and lowers most.

    DataFrame[direction ("promoted", then "suppressed"), rank, token, token_id, effect]: promoted from
    the largest effect down, suppressed from the most negative up. The one table behind a neuron's
    direct effect (``experiments.neurons``) and a block's vocabulary projection (``experiments.flow``).

    Example:
        >>> promoted_and_suppressed(model, model.W_U[:, :].T @ torch.zeros(model.cfg.d_model), k=3)   # doctest: +SKIP
    """
    if k < 1:
        raise InputError(f"k must be at least 1, got {k}")
    effect_V = effect_V.detach().float().cpu()
    k = min(k, effect_V.numel())
    top, bottom = effect_V.topk(k), effect_V.topk(k, largest=False)
    ids = torch.cat([top.indices, bottom.indices])
    return pd.DataFrame({"direction": ["promoted"] * k + ["suppressed"] * k, "rank": list(range(1, k + 1)) * 2,
                         "token": str_tokens(model, ids), "token_id": ids.numpy(),
                         "effect": torch.cat([top.values, bottom.values]).numpy()})


@torch.no_grad()
def direct_logit_attribution(model, tokens: TokensLike, target_token: TokenIds, baseline_token: Optional[TokenIds] = None,
                             position: PositionSelector = "last", *, per_prompt: bool = False,
                             attention_mask: Optional[Tensor] = None, padding_side: str = "right") -> pd.DataFrame:
    """Each component's direct contribution to logit[target] (minus logit[baseline]) at ``position``.

    Returns DataFrame[component, layer, head, attribution] with component in {"embed",
    "pos_embed", "head", "attn_bias", "mlp", "ln_final_bias", "unembed_bias"} (layer/head -1 where
    they do not apply); the rows sum to the logit (difference), stored in ``df.attrs["logit_diff"]``,
    with processed weights or without (``df.attrs["weights"]`` says which).

    Over a batch: ``target_token`` / ``baseline_token`` are one id or text, or one per prompt;
    ``position`` is "last" (each prompt's last real token, the default), an int column or one
    position per prompt; a padded batch takes ``attention_mask`` (a list of texts builds it). The
    attribution is the mean over prompts, so the rows sum to the mean logit difference
    (``attrs["logit_diff"]``; each prompt's in ``attrs["logit_diff_per_prompt"]``);
    ``per_prompt=True`` gives one row per component and prompt (a ``prompt`` column).

    Example:
        >>> dla = direct_logit_attribution(model, tokens, model.to_single_token(" Paris"), model.to_single_token(" Rome"))   # doctest: +SKIP
        >>> dla.attribution.sum(), dla.attrs["logit_diff"]                                                                # doctest: +SKIP
    """
    cfg = model.cfg
    if cfg.norm_placement != "pre":
        raise InputError(f"direct logit attribution needs a pre-norm model (norm_placement='pre', this one has "
                         f"{cfg.norm_placement!r}): a norm after a sublayer or after the residual sum mixes the "
                         f"components it sees non-linearly")
    if cfg.output_logits_soft_cap is not None or cfg.embed_norm:
        raise InputError("direct logit attribution needs logits linear in the residual stream and embeddings "
                         "entering it as they are: this model soft-caps its logits or norms its embeddings")
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    B = batch.size
    target_B = token_ids(model, target_token, B, "target_token")
    baseline_B = None if baseline_token is None else token_ids(model, baseline_token, B, "baseline_token")
    positions_B = batch.positions(position)
    if positions_B is None:
        raise InputError("direct logit attribution reads one position per prompt: position must be 'last', an int "
                         "or one position per prompt, not 'all'")
    rows_B = torch.arange(B, device=batch.tokens.device)
    pads = [] if batch.mask is None else (~batch.mask[rows_B, positions_B]).nonzero().flatten().tolist()
    if pads:
        raise InputError(f"position {position!r} is a pad in prompt(s) {pads}; read each prompt at a real token "
                         f"(position='last' is each prompt's last real token)")
    L = cfg.n_layers
    final = f"blocks.{L - 1}.hook_resid_post"
    names = {"hook_embed", final} | ({"hook_pos_embed"} & set(model.hook_dict))
    names |= {f"blocks.{l}.attn.hook_z" for l in range(L)} | {f"blocks.{l}.hook_mlp_out" for l in range(L)}
    _, cache = model.run_with_cache(batch.tokens, attention_mask=batch.mask, stop_at_layer=L,
                                    names_filter=lambda n: n in names)
    at = lambda name: cache[name][rows_B, positions_B]  # noqa: E731  each row at its own position: [B, ...]
    # Only the read positions go through the final norm and unembedding; the norm's scale is kept there.
    kept: dict[str, Tensor] = {}
    with model.hooks(fwd_hooks=[("ln_final.hook_scale", lambda scale, hook: kept.update(scale=scale))]):
        final_BV = model.logits_from_resid(at(final)[:, None])[:, 0].float()
    scale_B1 = kept["scale"][:, 0].float()

    direction_BD = model.tokens_to_residual_directions(target_B).float()
    if baseline_B is not None:
        direction_BD = direction_BD - model.tokens_to_residual_directions(baseline_B).float()

    def share(vectors_BnD: Tensor) -> Tensor:  # [B, n, d_model] -> each vector's share of each row's logit difference
        normed = model.apply_final_norm(vectors_BnD.float(), frozen_scale=scale_B1[:, None]).float()
        return torch.einsum("bnd,bd->bn", normed, direction_BD)

    parts: list[tuple[str, int, int, Tensor]] = [("embed", -1, -1, share(at("hook_embed")[:, None])[:, 0])]
    if "hook_pos_embed" in names:
        parts.append(("pos_embed", -1, -1, share(at("hook_pos_embed")[:, None])[:, 0]))
    for l in range(L):
        z_BHK = at(f"blocks.{l}.attn.hook_z").float()
        result_BHD = torch.einsum("bhk,hkd->bhd", z_BHK, model.layer_W_O(l).float())
        parts += [("head", l, h, values_B) for h, values_B in enumerate(share(result_BHD).unbind(1))]
        b_O = model.layer_b_O(l)  # None without a bias: no row (model.b_O would be zeros)
        if b_O is not None:
            parts.append(("attn_bias", l, -1, share(b_O.expand(B, 1, -1))[:, 0]))
        if not cfg.attn_only:
            parts.append(("mlp", l, -1, share(at(f"blocks.{l}.hook_mlp_out")[:, None])[:, 0]))
    if cfg.normalization == "LN":  # the bias is the norm of a zero vector
        bias_D = model.apply_final_norm(torch.zeros(1, cfg.d_model, dtype=cfg.dtype, device=cfg.device))[0]
        parts.append(("ln_final_bias", -1, -1, direction_BD @ bias_D.float()))
    if cfg.unembed_bias:  # where fold_ln put the final LayerNorm's bias
        b_U = model.b_U.float()
        parts.append(("unembed_bias", -1, -1, b_U[target_B] - (b_U[baseline_B] if baseline_B is not None else 0)))
    labels = pd.DataFrame([part[:3] for part in parts], columns=["component", "layer", "head"])
    values_nB = torch.stack([part[3] for part in parts]).cpu()
    if per_prompt:
        table = per_prompt_table(labels, values_nB, B, "direct logit attribution").rename(columns={"metric": "attribution"})
    else:
        table = labels.assign(attribution=values_nB.mean(1).numpy())
    # Exact with processed or unprocessed weights (the final norm's gain is read from the model); say which.
    table.attrs["weights"] = ("processed: " + ", ".join(cfg.weight_processing)) if cfg.weight_processing else "as loaded"
    logit_diff_B = final_BV[rows_B, target_B] - (final_BV[rows_B, baseline_B] if baseline_B is not None else 0.0)
    table.attrs["logit_diff"] = float(logit_diff_B.mean())
    table.attrs["logit_diff_per_prompt"] = logit_diff_B.tolist()
    return table


def dla_figure(df: pd.DataFrame, title: str = "Direct logit attribution") -> go.Figure:
    """Heads as a layer x head heatmap beside a bar chart of the other components.

    Example:
        >>> dla_figure(direct_logit_attribution(model, tokens, target))   # doctest: +SKIP
    """
    heads = df[df.component == "head"].pivot(index="layer", columns="head", values="attribution")
    others = df[df.component != "head"]
    labels = [c if l < 0 else f"{c} {l}" for c, l in zip(others.component, others.layer)]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55], subplot_titles=["heads", "other components"])
    bound = float(np.nanmax(np.abs(heads.values))) if heads.size else 1.0
    fig.add_trace(go.Heatmap(z=heads.values, x=list(heads.columns), y=list(heads.index), colorscale="RdBu",
                             zmid=0, zmin=-bound, zmax=bound, colorbar=dict(title="logit", x=0.42),
                             hovertemplate="L%{y}H%{x}<br>attribution=%{z:.4f}<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Bar(x=labels, y=others.attribution, marker_color=np.where(others.attribution >= 0, "#2166ac", "#b2182b"),
                         hovertemplate="%{x}<br>attribution=%{y:.4f}<extra></extra>", showlegend=False), row=1, col=2)
    fig.update_yaxes(autorange="reversed", title_text="layer", row=1, col=1)
    fig.update_xaxes(title_text="head", row=1, col=1)
    total = df.attrs.get("logit_diff")
    fig.update_layout(title=title + (f" (total {total:.3f})" if total is not None else ""),
                      height=max(400, 20 * heads.shape[0] + 200), width=1100)
    return fig


def main(argv: Optional[Sequence[str]] = None) -> None:
    from experiments import _cli

    parser = _cli.make_parser("Logit lens over every layer, and direct logit attribution at the last position.", "lens")
    parser.add_argument("--prompt", default=None)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--target", default=None, help="token text for the attribution (default: the model's top prediction)")
    parser.add_argument("--baseline", default=None, help="token text to subtract (optional)")
    args = parser.parse_args(argv)
    model = _cli.load(args)
    tokens = _cli.prompt_tokens(model, args.prompt)
    labels = str_tokens(model, tokens[0])
    lens_df = logit_lens(model, tokens, args.top_k)
    _cli.write_outputs(args.out, "logit_lens", lens_df, logit_lens_figure(lens_df, labels),
                       {"experiment": "logit_lens", "model": args.model, "str_tokens": labels})
    target = model.to_single_token(args.target) if args.target else int(model(tokens)[0, -1].argmax())
    baseline = model.to_single_token(args.baseline) if args.baseline else None
    dla = direct_logit_attribution(model, tokens, target, baseline)
    _cli.write_outputs(args.out, "dla", dla, dla_figure(dla),
                       {"experiment": "direct_logit_attribution", "model": args.model, "target_token": target,
                        "baseline_token": baseline, "logit_diff": dla.attrs["logit_diff"]})


if __name__ == "__main__":
    from experiments._cli import run_main

    run_main(main)
