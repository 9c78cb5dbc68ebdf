"""Logit lens and direct logit attribution.

Legend: L n_layers, P position, H n_heads, K d_head, D d_model, V d_vocab, T residual snapshots.

Logit lens: the residual stream entering each layer (and the final one) is read out through
the model's own final norm and unembedding (``Decoder.logits_from_resid``), so snapshot L is
exactly the model's logits.

Direct logit attribution (pre-norm models): the final residual is a sum of components
(embeddings, each head's output, each attention bias, each MLP output). With the final norm's
scale frozen at its value on this input, the norm is linear (``Decoder.apply_final_norm`` with
``frozen_scale``), so each component's share of logit[target] - logit[baseline] is
norm(component) . (W_U[target] - W_U[baseline]); a LayerNorm bias adds one more term. The shares sum exactly to the logit difference.

``python -m experiments.lens --model NAME --out DIR [--prompt TEXT --target TEXT --baseline TEXT]``
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Float
from plotly.subplots import make_subplots
from torch import Tensor

from experiments._tokens import TokensLike, axis_labels, str_tokens
from experiments.figures import labelled_heatmap
from workbench.errors import InputError

LOGITS_BYTES_PER_CHUNK = 2**28


@torch.no_grad()
def residual_snapshots(model, tokens: TokensLike) -> Float[Tensor, "snapshots pos d_model"]:
    """The residual stream of batch item 0 entering each layer, then after the last: [L + 1, P, D].

    Example:
        >>> residual_snapshots(model, tokens).shape   # doctest: +SKIP
        torch.Size([31, 12, 576])
    """
    tokens_1P = model.as_tokens(tokens)[:1]
    L = model.cfg.n_layers
    names = [f"blocks.{l}.hook_resid_pre" for l in range(L)] + [f"blocks.{L - 1}.hook_resid_post"]
    _, cache = model.run_with_cache(tokens_1P, names_filter=lambda n: n in names)
    return torch.cat([cache[name] for name in names])


@torch.no_grad()
def logit_lens_logits(model, tokens: TokensLike) -> Float[Tensor, "snapshots pos d_vocab"]:
    """Every snapshot through the final norm and unembedding: [L + 1, P, V]; the last is the model's logits.

    Example:
        >>> torch.allclose(logit_lens_logits(model, tokens)[-1], model(tokens)[0])   # doctest: +SKIP
        True
    """
    return model.logits_from_resid(residual_snapshots(model, tokens))


@torch.no_grad()
def logit_lens(model, tokens: TokensLike, top_k: int = 5) -> pd.DataFrame:
    """Top-k tokens of each layer's residual stream at each position (batch item 0).

    Returns DataFrame[layer, position, rank, token, token_id, prob]; layer l < n_layers is the
    stream entering block l, layer n_layers the final stream (the model's own prediction).

    Example:
        >>> df = logit_lens(model, model.to_tokens("The Eiffel Tower is in the city of"))   # doctest: +SKIP
        >>> df[(df["rank"] == 1) & (df.position == df.position.max())]                      # doctest: +SKIP
    """
    if top_k < 1:
        raise InputError(f"top_k must be at least 1, got {top_k}")
    resid_TPD = residual_snapshots(model, tokens)
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


def logit_lens_figure(df: pd.DataFrame, str_toks: Optional[Sequence[str]] = None) -> go.Figure:
    """Layer x position grid of each snapshot's top-1 token, coloured by its probability.

    Example:
        >>> logit_lens_figure(logit_lens(model, tokens), model.to_str_tokens(tokens))   # doctest: +SKIP
    """
    top = df[df["rank"] == 1]
    prob = top.pivot(index="layer", columns="position", values="prob")
    token = top.pivot(index="layer", columns="position", values="token")
    n_layers = int(top["layer"].max())
    y_labels = [f"resid_pre {l}" if l < n_layers else "final" for l in prob.index]
    x_labels = axis_labels(list(str_toks)) if str_toks is not None else [str(p) for p in prob.columns]
    text = [[str(t)[:10] for t in row] for row in token.values]
    fig = labelled_heatmap(prob.values, x_labels, y_labels, title="Logit lens: top token per layer and position",
                           x_title="position", y_title="layer", value_name="prob", text=text, colorscale="Blues")
    fig.update_traces(zmin=0, zmax=1, textfont=dict(size=9))
    fig.update_layout(height=max(400, 22 * len(y_labels) + 150), width=max(600, 70 * len(x_labels) + 200))
    return fig


@torch.no_grad()
def direct_logit_attribution(model, tokens: TokensLike, target_token: int, baseline_token: Optional[int] = None,
                             position: int = -1) -> pd.DataFrame:
    """Each component's direct contribution to logit[target] (minus logit[baseline]) at ``position``.

    Returns DataFrame[component, layer, head, attribution] with component in {"embed",
    "pos_embed", "head", "attn_bias", "mlp", "ln_final_bias", "unembed_bias"} (layer/head -1 where
    they do not apply); the rows sum to the logit (difference), stored in ``df.attrs["logit_diff"]``,
    with processed weights or without (``df.attrs["weights"]`` says which).

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
    for name, token in (("target_token", target_token), ("baseline_token", baseline_token)):
        if token is not None and not 0 <= int(token) < cfg.d_vocab:
            raise InputError(f"{name}={token} is outside the vocabulary (0..{cfg.d_vocab - 1})")
    tokens_1P = model.as_tokens(tokens)[:1]
    L = cfg.n_layers
    names = {"hook_embed", "ln_final.hook_scale"} | ({"hook_pos_embed"} & set(model.hook_dict))
    names |= {f"blocks.{l}.attn.hook_z" for l in range(L)} | {f"blocks.{l}.hook_mlp_out" for l in range(L)}
    logits, cache = model.run_with_cache(tokens_1P, names_filter=lambda n: n in names)

    direction_D = model.tokens_to_residual_directions(target_token).float()
    if baseline_token is not None:
        direction_D = direction_D - model.tokens_to_residual_directions(baseline_token).float()
    scale_1 = cache["ln_final.hook_scale"][0, position].float()

    def share(vectors: Tensor) -> Tensor:  # [n_vectors, d_model] -> each one's share of the logit difference
        return model.apply_final_norm(vectors.float(), frozen_scale=scale_1).float() @ direction_D

    rows = [("embed", -1, -1, share(cache["hook_embed"][0, position][None]).item())]
    if "hook_pos_embed" in names:
        rows.append(("pos_embed", -1, -1, share(cache["hook_pos_embed"][0, position][None]).item()))
    for l in range(L):
        attn = model.blocks[l].attn
        z_HK = cache[f"blocks.{l}.attn.hook_z"][0, position].float()
        result_HD = torch.einsum("hk,hkd->hd", z_HK, attn.W_O.float())
        rows += [("head", l, h, v) for h, v in enumerate(share(result_HD).tolist())]
        if attn.b_O is not None:
            rows.append(("attn_bias", l, -1, share(attn.b_O[None]).item()))
        if not cfg.attn_only:
            rows.append(("mlp", l, -1, share(cache[f"blocks.{l}.hook_mlp_out"][0, position][None]).item()))
    if cfg.normalization == "LN":  # the bias is the norm of a zero vector
        bias_D = model.apply_final_norm(torch.zeros(1, cfg.d_model, dtype=cfg.dtype, device=cfg.device))[0]
        rows.append(("ln_final_bias", -1, -1, float(bias_D.float() @ direction_D)))
    if cfg.unembed_bias:  # where fold_ln put the final LayerNorm's bias
        b_U = model.b_U.float()
        rows.append(("unembed_bias", -1, -1, float(b_U[target_token] - (b_U[baseline_token] if baseline_token is not None else 0))))
    table = pd.DataFrame(rows, columns=["component", "layer", "head", "attribution"])
    # Exact with processed or unprocessed weights (the final norm's gain is read from the model); say which.
    table.attrs["weights"] = ("processed: " + ", ".join(cfg.weight_processing)) if cfg.weight_processing else "as loaded"
    final = logits[0, position].float()
    table.attrs["logit_diff"] = float(final[target_token] - (final[baseline_token] if baseline_token is not None else 0.0))
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

    parser = _cli.make_parser("Logit lens over every layer, and direct logit attribution at the last position.")
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
