"""Mixture-of-experts routing: expert load, router entropy, per-token choices, shared vs routed
experts, expert ablation.

Legend: B batch, P position, D d_model, E num_experts, k experts_per_token.

Reads the MoE hooks ``blocks.{l}.mlp.hook_router_logits`` [B, P, E], ``hook_expert_indices``
and ``hook_expert_weights`` [B, P, k], and, with shared experts, ``hook_shared_out`` [B, P, D].
Only the layers with experts are read (``cfg.moe_layers``: DeepSeek's first layers are dense),
each with its own expert count (``cfg.layer_values("num_experts")``); every table's ``layer``
column is the real layer index. A model without experts is an InputError.

``python -m experiments.router --model NAME --out DIR [--prompt TEXT]``
The command line is ``experiments.cli.router``, the figures ``experiments.plots.router``.
"""

from __future__ import annotations


import pandas as pd
import torch
from torch import Tensor

from experiments._tokens import str_tokens
from workbench.tokens_api import TextOrTokens
from workbench.errors import InputError


def _require_moe(model) -> list[int]:
    """The layers with experts; InputError for a model that has none."""
    if not model.cfg.is_moe:
        raise InputError(f"model {model.cfg.model_name!r} is not a mixture-of-experts model (num_experts=0): "
                         "router experiments need one, e.g. a Mixtral-style checkpoint")
    return model.cfg.moe_layers


def _experts_of(cfg, layer: int) -> int:
    return cfg.layer_values("num_experts")[layer]


@torch.no_grad()
def routing(model, tokens: TextOrTokens) -> dict[str, dict[int, Tensor]]:
    """Per MoE layer (keyed by layer index): router logits [B, P, E], chosen experts and their weights [B, P, k].

    Dense layers of a model that mixes them with MoE layers (DeepSeek's first layers) have no
    router and no key. The logits are ``hook_router_logits`` (the router's linear map, bias
    included, before scoring, correction bias or group mask); the weights are the final ones the
    experts' outputs are scaled by.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers, top-2 of 4 experts
        >>> route = routing(moe_model, "The cat sat on the mat. The cat")   # 14 tokens
        >>> route["logits"][1].shape, route["indices"][1].shape   # layer 1's logits and chosen experts
        (torch.Size([1, 14, 4]), torch.Size([1, 14, 2]))
    """
    layers = _require_moe(model)
    tokens_BP = model.as_tokens(tokens)
    kinds = {"logits": "hook_router_logits", "indices": "hook_expert_indices", "weights": "hook_expert_weights"}
    names = {f"blocks.{l}.mlp.{hook}" for l in layers for hook in kinds.values()}
    _, cache = model.run_with_cache(tokens_BP, names_filter=lambda n: n in names)
    return {kind: {l: cache[f"blocks.{l}.mlp.{hook}"] for l in layers} for kind, hook in kinds.items()}


def expert_load(model, tokens: TextOrTokens) -> pd.DataFrame:
    """How much each expert is used per MoE layer: DataFrame[layer, expert, count, fraction, token_fraction].

    ``count``: the (token, slot) assignments the expert received. ``fraction``: its share of all
    assignments (sums to one per layer; a balanced router gives 1 / num_experts each).
    ``token_fraction``: the share of tokens that chose it among their k (sums to k per layer; the
    top-k experts of a token are distinct). Each layer lists its own experts; dense layers are absent.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers, top-2 of 4 experts
        >>> load = expert_load(moe_model, "The cat sat on the mat. The cat")
        >>> load.pivot(index="layer", columns="expert", values="count").values.tolist()
        [[5, 4, 12, 7], [9, 11, 6, 2]]
        >>> load.groupby("layer").fraction.sum().round(6).tolist(), load.groupby("layer").token_fraction.sum().round(6).tolist()
        ([1.0, 1.0], [2.0, 2.0])
    """
    route = routing(model, tokens)
    rows = []
    for layer, indices_BPk in route["indices"].items():
        counts_E = torch.bincount(indices_BPk.flatten().cpu(), minlength=_experts_of(model.cfg, layer))
        n_tokens = indices_BPk.numel() // indices_BPk.shape[-1]
        token_fraction_E = (counts_E.float() / n_tokens).tolist()  # float32, as a mean over tokens gives
        rows += [(layer, e, int(c), float(c) / indices_BPk.numel(), token_fraction_E[e]) for e, c in enumerate(counts_E)]
    return pd.DataFrame(rows, columns=["layer", "expert", "count", "fraction", "token_fraction"])


def router_entropy(model, tokens: TextOrTokens) -> pd.DataFrame:
    """Entropy (nats) of the router's distribution over all experts, per MoE layer and position (batch mean).

    The distribution is read from ``hook_router_logits`` as the router scores them: for softmax
    routers (Mixtral, Qwen2/3-MoE, DeepSeek-V2) and topk_softmax ones (gpt-oss) the softmax over all
    experts' logits; for sigmoid routers (DeepSeek-V3), whose scores do not sum to one, the
    entropy of the sigmoid scores normalised to sum to one. A correction bias or group mask,
    which only pick the experts, is not part of it. Uniform routing gives log(num_experts).

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers, top-2 of 4 experts
        >>> entropy = router_entropy(moe_model, "The cat sat on the mat. The cat")
        >>> entropy.shape, bool(entropy.entropy.between(0, torch.log(torch.tensor(4.0)).item()).all())
        ((28, 3), True)
    """
    route = routing(model, tokens)
    rows = []
    for layer, logits_BPE in route["logits"].items():
        probs_BPE = model.router_probabilities(layer, logits_BPE)
        entropy_P = -torch.special.xlogy(probs_BPE, probs_BPE).sum(-1).mean(0)
        rows += [(layer, p, float(h)) for p, h in enumerate(entropy_P.tolist())]
    return pd.DataFrame(rows, columns=["layer", "position", "entropy"])


def token_expert_choices(model, tokens: TextOrTokens) -> pd.DataFrame:
    """Which experts each token of batch item 0 was sent to, with their weights: DataFrame[position, token, layer, experts, weights].

    One row per (position, MoE layer); the weights are the final ones (after renormalising and
    ``routed_scaling_factor``).

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers, top-2 of 4 experts
        >>> choices = token_expert_choices(moe_model, moe_model.to_tokens("Hello world"))
        >>> choices.query("layer == 0")[["token", "experts"]].values.tolist()[:3]
        [['<|endoftext|>', [0, 2]], ['H', [1, 3]], ['el', [2, 1]]]
        >>> bool(choices.weights.map(sum).round(5).eq(1).all())   # renormalised top-2 weights
        True
    """
    tokens_BP = model.as_tokens(tokens)
    route = routing(model, tokens_BP[:1])
    labels = str_tokens(model, tokens_BP[0])
    rows = []
    for layer, indices in route["indices"].items():
        weights = route["weights"][layer]
        for p, label in enumerate(labels):
            rows.append((p, label, layer, indices[0, p].tolist(), [round(w, 6) for w in weights[0, p].float().tolist()]))
    return pd.DataFrame(rows, columns=["position", "token", "layer", "experts", "weights"])


@torch.no_grad()
def top_expert_predictability(model, tokens: TextOrTokens) -> dict[str, list]:
    """How well the token id, vs the position alone, predicts each MoE layer's top-1 expert on unseen rows.

    The first half of the rows fits a lookup table (the most common top expert for each token
    id, or for each position; the overall most common one for ids it never saw); the second
    half scores it. Routing by content shows as "by_token" accuracy far above "by_position".
    ``layer`` names the MoE layer of each entry.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers, top-2 of 4 experts
        >>> rows = moe_model.to_tokens("The cat sat on the mat.").repeat(4, 1)   # the same row: both predict it
        >>> top_expert_predictability(moe_model, rows)
        {'layer': [0, 1], 'by_token': [1.0, 1.0], 'by_position': [1.0, 1.0]}
    """
    tokens_BP = model.as_tokens(tokens)
    half = tokens_BP.shape[0] // 2
    tokens_BP = tokens_BP.cpu()
    positions_BP = torch.arange(tokens_BP.shape[1]).expand_as(tokens_BP)
    result: dict[str, list] = {"layer": [], "by_token": [], "by_position": []}
    for layer, indices_BPk in routing(model, tokens_BP)["indices"].items():
        result["layer"].append(layer)
        top_BP = indices_BPk[..., 0].cpu()
        for key, groups_BP in (("by_token", tokens_BP), ("by_position", positions_BP)):
            # G: token ids or positions
            counts_GE = torch.zeros(int(groups_BP.max()) + 1, _experts_of(model.cfg, layer))
            fit_groups, fit_top = groups_BP[:half].flatten(), top_BP[:half].flatten()
            counts_GE.index_put_((fit_groups, fit_top), torch.ones(fit_top.numel()), accumulate=True)
            guess_G = counts_GE.argmax(-1)
            guess_G[counts_GE.sum(-1) == 0] = counts_GE.sum(0).argmax()  # unseen: overall favourite
            hits = guess_G[groups_BP[half:]] == top_BP[half:]
            result[key].append(hits.float().mean().item())
    return result


def shared_expert_layers(model) -> list[int]:
    """The MoE layers with a shared expert (``hook_shared_out``), or [] when the model has none.

    Example:
        >>> dense_first = ({"num_experts": 0, "experts_per_token": 0, "d_mlp": 64}, {}, {})   # layer 0 is dense
        >>> deepseek_v3_like = wb.Decoder(wb.ModelConfig(n_layers=3, d_model=32, n_heads=4, d_vocab=50, n_ctx=16,
        ...                     d_mlp=16, num_experts=4, experts_per_token=2, moe=wb.MoEConfig(d_shared_expert=24),
        ...                     layer_overrides=dense_first))
        >>> shared_expert_layers(deepseek_v3_like), shared_expert_layers(wb.load_model("toy-moe-2l", progress=False))
        ([1, 2], [])
    """
    return [l for l in model.cfg.moe_layers if f"blocks.{l}.mlp.hook_shared_out" in model.hook_dict]


def _require_shared(model) -> list[int]:
    """The MoE layers with a shared expert; InputError when there are none or the split is not additive."""
    _require_moe(model)
    layers, cfg = shared_expert_layers(model), model.cfg
    if not layers:
        raise InputError(f"model {cfg.model_name!r} has no shared expert (d_shared_expert=0): every token's MLP output "
                         "is its routed experts' alone, so there is no shared part to compare (DeepSeek-V2/V3 and "
                         "Qwen2-MoE have shared experts)")
    if cfg.norm_placement in ("sandwich", "sublayer_output"):
        raise InputError(f"model {cfg.model_name!r} normalises the MLP output (norm_placement={cfg.norm_placement!r}), "
                         "so hook_mlp_out is not the routed plus the shared experts' output")
    return layers


@torch.no_grad()
def shared_vs_routed(model, tokens: TextOrTokens) -> pd.DataFrame:
    """What the shared and the routed experts each write to the residual stream, per layer and position of row 0.

    DataFrame[layer, position, routed_norm, shared_norm, shared_fraction]: ``shared_norm`` is the
    L2 norm of ``hook_shared_out`` (the shared expert's output, its gate included), ``routed_norm``
    that of the routed experts' part ``hook_mlp_out - hook_shared_out`` (their weighted sum), and
    ``shared_fraction`` = shared_norm / (routed_norm + shared_norm). Only the MoE layers with a
    shared expert (DeepSeek-V2/V3, Qwen2-MoE); a model without one is an InputError.

    Example:
        >>> tiny = dict(d_model=32, n_heads=4, d_vocab=model.cfg.d_vocab, n_ctx=32, d_mlp=16, num_experts=4,
        ...             experts_per_token=2, moe=wb.MoEConfig(d_shared_expert=24))
        >>> shared_model = wb.Decoder(wb.ModelConfig(n_layers=2, **tiny), tokenizer=model.tokenizer)   # random weights
        >>> df = shared_vs_routed(shared_model, shared_model.to_tokens("Hello world"))   # 7 tokens
        >>> df.shape, list(df.columns), bool(df.shared_fraction.between(0, 1).all())
        ((14, 5), ['layer', 'position', 'routed_norm', 'shared_norm', 'shared_fraction'], True)
    """
    layers = _require_shared(model)
    tokens_BP = model.as_tokens(tokens)[:1]
    names = {name for l in layers for name in (f"blocks.{l}.hook_mlp_out", f"blocks.{l}.mlp.hook_shared_out")}
    _, cache = model.run_with_cache(tokens_BP, names_filter=lambda n: n in names)
    rows = []
    for layer in layers:
        shared_PD = cache[f"blocks.{layer}.mlp.hook_shared_out"][0].float()
        routed_PD = cache[f"blocks.{layer}.hook_mlp_out"][0].float() - shared_PD
        routed_P, shared_P = routed_PD.norm(dim=-1), shared_PD.norm(dim=-1)
        fraction_P = shared_P / (routed_P + shared_P)
        rows += [(layer, p, r, s, f) for p, (r, s, f)
                 in enumerate(zip(routed_P.tolist(), shared_P.tolist(), fraction_P.tolist()))]
    return pd.DataFrame(rows, columns=["layer", "position", "routed_norm", "shared_norm", "shared_fraction"])


@torch.no_grad()
def expert_ablation_effect(model, tokens: TextOrTokens, layer: int, expert: int) -> dict[str, float]:
    """Mean loss with and without expert ``expert`` of MoE layer ``layer`` (its router weight zeroed where chosen).

    Goes through ``experiments.ablation`` (``AblationTarget("expert", layer, expert)``): a dense
    layer or an expert the layer does not have is an InputError naming it.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers, top-2 of 4 experts
        >>> effect = expert_ablation_effect(moe_model, "The cat sat on the mat. The cat", layer=0, expert=3)
        >>> sorted(effect), effect["delta"] == effect["ablated_loss"] - effect["clean_loss"]
        (['ablated_loss', 'clean_loss', 'delta'], True)
        >>> expert_ablation_effect(moe_model, "The cat", layer=0, expert=4)
        Traceback (most recent call last):
        workbench.errors.InputError: ...
    """
    from experiments.ablation import AblationTarget, run_ablated

    _require_moe(model)
    tokens_BP = model.as_tokens(tokens)
    target = AblationTarget("expert", layer, expert)
    target.check(model.cfg)  # before the clean run: a wrong layer or expert fails at once
    clean = float(model(tokens_BP, return_type="loss"))
    ablated = float(run_ablated(model, tokens_BP, [target], "zero", return_type="loss"))
    return {"clean_loss": clean, "ablated_loss": ablated, "delta": ablated - clean}




if __name__ == "__main__":  # the command line lives in experiments.cli.router
    from experiments._cli import run_command

    run_command("router")
