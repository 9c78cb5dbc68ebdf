"""Mixture-of-experts routing: expert load, router entropy, per-token choices, expert ablation.

Legend: B batch, P position, E num_experts, k experts_per_token, L n_layers.

Reads the MoE hooks ``blocks.{l}.mlp.hook_router_logits`` [B, P, E], ``hook_expert_indices``
and ``hook_expert_weights`` [B, P, k]. A model without experts is an InputError.

``python -m experiments.router --model NAME --out DIR [--prompt TEXT]``
"""

from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch
from torch import Tensor

from experiments._tokens import TokensLike, str_tokens
from experiments.figures import labelled_heatmap
from workbench.errors import InputError


def _require_moe(model) -> None:
    if not model.cfg.is_moe:
        raise InputError(f"model {model.cfg.model_name!r} is not a mixture-of-experts model (num_experts=0): "
                         "router experiments need one, e.g. a Mixtral-style checkpoint")


@torch.no_grad()
def routing(model, tokens: TokensLike) -> dict[str, list[Tensor]]:
    """Per layer: router logits [B, P, E], chosen experts [B, P, k] and their weights [B, P, k].

    Example:
        >>> routing(moe_model, tokens)["indices"][0].shape   # doctest: +SKIP
    """
    _require_moe(model)
    tokens_BP = model.as_tokens(tokens)
    L = model.cfg.n_layers
    kinds = {"logits": "hook_router_logits", "indices": "hook_expert_indices", "weights": "hook_expert_weights"}
    names = {f"blocks.{l}.mlp.{hook}" for l in range(L) for hook in kinds.values()}
    _, cache = model.run_with_cache(tokens_BP, names_filter=lambda n: n in names)
    return {kind: [cache[f"blocks.{l}.mlp.{hook}"] for l in range(L)] for kind, hook in kinds.items()}


def expert_load(model, tokens: TokensLike) -> pd.DataFrame:
    """How much each expert is used per layer: DataFrame[layer, expert, count, fraction, token_fraction].

    ``count``: the (token, slot) assignments the expert received. ``fraction``: its share of all
    assignments (sums to one per layer; a balanced router gives 1 / num_experts each).
    ``token_fraction``: the share of tokens that chose it among their k (sums to k per layer; the
    top-k experts of a token are distinct).

    Example:
        >>> expert_load(moe_model, tokens).pivot(index="layer", columns="expert", values="fraction")   # doctest: +SKIP
    """
    route = routing(model, tokens)
    E = model.cfg.num_experts
    rows = []
    for layer, indices_BPk in enumerate(route["indices"]):
        counts_E = torch.bincount(indices_BPk.flatten().cpu(), minlength=E)
        n_tokens = indices_BPk.numel() // indices_BPk.shape[-1]
        token_fraction_E = (counts_E.float() / n_tokens).tolist()  # float32, as a mean over tokens gives
        rows += [(layer, e, int(c), float(c) / indices_BPk.numel(), token_fraction_E[e]) for e, c in enumerate(counts_E)]
    return pd.DataFrame(rows, columns=["layer", "expert", "count", "fraction", "token_fraction"])


def router_entropy(model, tokens: TokensLike) -> pd.DataFrame:
    """Entropy (nats) of the router's softmax over all experts, per layer and position (mean over the batch).

    Example:
        >>> router_entropy(moe_model, tokens).groupby("layer").entropy.mean()   # doctest: +SKIP
    """
    route = routing(model, tokens)
    rows = []
    for layer, logits_BPE in enumerate(route["logits"]):
        logp = logits_BPE.float().log_softmax(-1)
        entropy_P = -(logp.exp() * logp).sum(-1).mean(0)
        rows += [(layer, p, float(h)) for p, h in enumerate(entropy_P.tolist())]
    return pd.DataFrame(rows, columns=["layer", "position", "entropy"])


def token_expert_choices(model, tokens: TokensLike) -> pd.DataFrame:
    """Which experts each token of batch item 0 was sent to, with their weights: DataFrame[position, token, layer, experts, weights].

    Example:
        >>> token_expert_choices(moe_model, moe_model.to_tokens("Hello world"))   # doctest: +SKIP
    """
    tokens_BP = model.as_tokens(tokens)
    route = routing(model, tokens_BP[:1])
    labels = str_tokens(model, tokens_BP[0])
    rows = []
    for layer, (indices, weights) in enumerate(zip(route["indices"], route["weights"])):
        for p, label in enumerate(labels):
            rows.append((p, label, layer, indices[0, p].tolist(), [round(w, 6) for w in weights[0, p].float().tolist()]))
    return pd.DataFrame(rows, columns=["position", "token", "layer", "experts", "weights"])


@torch.no_grad()
def top_expert_predictability(model, tokens: TokensLike) -> dict[str, list[float]]:
    """How well the token id, vs the position alone, predicts each layer's top-1 expert on unseen rows.

    The first half of the rows fits a lookup table (the most common top expert for each token
    id, or for each position; the overall most common one for ids it never saw); the second
    half scores it. Routing by content shows as "by_token" accuracy far above "by_position".

    Example:
        >>> top_expert_predictability(moe_model, tokens)   # doctest: +SKIP
        {'by_token': [0.8, 0.7], 'by_position': [0.4, 0.4]}
    """
    tokens_BP = model.as_tokens(tokens)
    half = tokens_BP.shape[0] // 2
    tokens_BP = tokens_BP.cpu()
    positions_BP = torch.arange(tokens_BP.shape[1]).expand_as(tokens_BP)
    result: dict[str, list[float]] = {"by_token": [], "by_position": []}
    for indices_BPk in routing(model, tokens_BP)["indices"]:
        top_BP = indices_BPk[..., 0].cpu()
        for key, groups_BP in (("by_token", tokens_BP), ("by_position", positions_BP)):
            counts_GE = torch.zeros(int(groups_BP.max()) + 1, model.cfg.num_experts)  # G: token ids or positions
            fit_groups, fit_top = groups_BP[:half].flatten(), top_BP[:half].flatten()
            counts_GE.index_put_((fit_groups, fit_top), torch.ones(fit_top.numel()), accumulate=True)
            guess_G = counts_GE.argmax(-1)
            guess_G[counts_GE.sum(-1) == 0] = counts_GE.sum(0).argmax()  # unseen: overall favourite
            hits = guess_G[groups_BP[half:]] == top_BP[half:]
            result[key].append(hits.float().mean().item())
    return result


@torch.no_grad()
def expert_ablation_effect(model, tokens: TokensLike, layer: int, expert: int) -> dict[str, float]:
    """Mean loss with and without expert ``expert`` of ``layer`` (its router weight zeroed where chosen).

    Example:
        >>> expert_ablation_effect(moe_model, tokens, layer=0, expert=3)   # doctest: +SKIP
        {'clean_loss': 3.2, 'ablated_loss': 3.5, 'delta': 0.3}
    """
    from experiments.ablation import AblationTarget, run_ablated

    _require_moe(model)
    tokens_BP = model.as_tokens(tokens)
    clean = float(model(tokens_BP, return_type="loss"))
    ablated = float(run_ablated(model, tokens_BP, [AblationTarget("expert", layer, expert)], "zero", return_type="loss"))
    return {"clean_loss": clean, "ablated_loss": ablated, "delta": ablated - clean}


def expert_load_figure(df: pd.DataFrame) -> go.Figure:
    """Layer x expert heatmap of the load fraction.

    Example:
        >>> expert_load_figure(expert_load(moe_model, tokens))   # doctest: +SKIP
    """
    grid = df.pivot(index="layer", columns="expert", values="fraction")
    fig = labelled_heatmap(grid.values, [str(e) for e in grid.columns], [str(l) for l in grid.index],
                           title="Expert load (share of routed token slots)", x_title="expert", y_title="layer",
                           value_name="fraction", colorscale="Viridis")
    return fig


def main(argv: Optional[Sequence[str]] = None) -> None:
    from experiments import _cli

    parser = _cli.make_parser("Mixture-of-experts routing: expert load and router entropy.")
    parser.add_argument("--prompt", default=None)
    args = parser.parse_args(argv)
    model = _cli.load(args)
    if not model.cfg.is_moe:
        raise SystemExit(f"{args.model or 'the default model'} has no mixture of experts; the router experiment needs one")
    tokens = _cli.prompt_tokens(model, args.prompt)
    load = expert_load(model, tokens)
    entropy = router_entropy(model, tokens)
    _cli.write_outputs(args.out, "router", load, expert_load_figure(load),
                       {"experiment": "router", "model": args.model,
                        "mean_router_entropy_by_layer": entropy.groupby("layer").entropy.mean().to_dict()})


if __name__ == "__main__":
    from experiments._cli import run_main

    run_main(main)
