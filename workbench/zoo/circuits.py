"""Measurements the model cards report: induction and previous-token heads, and MoE expert load.

Legend: B batch, L layers, H heads, S seq_len (one copy), P positions, E num_experts, k experts_per_token.

These are computed straight from ``hook_pattern`` / ``hook_expert_indices`` so the library
(``workbench``) does not depend on ``experiments`` (data flows the other way); the
``experiments`` package has the full-featured versions.

Example:
    >>> scores_LH = induction_scores(model)      # doctest: +SKIP
"""

from __future__ import annotations

from typing import Optional

import torch
from jaxtyping import Float, Int
from torch import Tensor

from workbench.model import Decoder


def repeated_random_tokens(d_vocab: int, seq_len: int, batch: int, seed: int = 0, bos: int = 0) -> Int[Tensor, "batch pos"]:
    """[batch, 1 + 2*seq_len]: BOS, then seq_len distinct random non-BOS tokens, then the same again.

    Example:
        >>> tokens = repeated_random_tokens(100, seq_len=5, batch=2)
        >>> tokens.shape, torch.equal(tokens[:, 1:6], tokens[:, 6:])
        (torch.Size([2, 11]), True)
    """
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        draw = torch.randperm(d_vocab - 1, generator=generator)[:seq_len]
        rows.append(draw + (draw >= bos).long())  # skip the BOS id
    copy_BS = torch.stack(rows)
    return torch.cat([torch.full((batch, 1), bos, dtype=torch.long), copy_BS, copy_BS], dim=1)


def _zero_heads_hooks(ablate: Optional[dict[int, list[int]]]) -> list:
    """run_with_hooks entries that zero the given heads' z (their output) in the given layers."""
    hooks = []
    for layer, heads in (ablate or {}).items():
        def zero(z_BPHK: Tensor, hook, heads=tuple(heads)) -> Tensor:
            z_BPHK[:, :, list(heads)] = 0.0
            return z_BPHK

        hooks.append((f"blocks.{layer}.attn.hook_z", zero))
    return hooks


@torch.no_grad()
def patterns(model: Decoder, tokens_BP: Int[Tensor, "batch pos"],
             ablate: Optional[dict[int, list[int]]] = None) -> list[Float[Tensor, "batch n_heads pos pos"]]:
    """Every layer's attention pattern, optionally with some heads zero-ablated ({layer: [heads]})."""
    found: dict[int, Tensor] = {}

    def keep(pattern_BHQK: Tensor, hook) -> None:
        found[int(hook.name.split(".")[1])] = pattern_BHQK.detach().float()

    hooks = _zero_heads_hooks(ablate) + [(f"blocks.{l}.attn.hook_pattern", keep) for l in range(model.cfg.n_layers)]
    model.run_with_hooks(tokens_BP, return_type=None, fwd_hooks=hooks)
    return [found[l] for l in range(model.cfg.n_layers)]


def induction_scores(model: Decoder, seq_len: int = 50, batch: int = 16, seed: int = 0,
                     ablate: Optional[dict[int, list[int]]] = None) -> Float[Tensor, "n_layers n_heads"]:
    """Mean attention from each second-copy token (position i) to i - seq_len + 1, on repeated random tokens.

    Example:
        >>> induction_scores(model)[1].max()     # doctest: +SKIP
    """
    tokens = repeated_random_tokens(model.cfg.d_vocab, seq_len, batch, seed)
    queries = torch.arange(seq_len + 1, 2 * seq_len + 1)
    return torch.stack([p[:, :, queries, queries - seq_len + 1].mean((0, 2)) for p in patterns(model, tokens, ablate)])


def previous_token_scores(model: Decoder, tokens_BP: Int[Tensor, "batch pos"]) -> Float[Tensor, "n_layers n_heads"]:
    """Mean attention from each position q >= 1 to q - 1.

    Example:
        >>> previous_token_scores(model, model.to_tokens("x = 1\\ny = 2"))[0]    # doctest: +SKIP
    """
    queries = torch.arange(1, tokens_BP.shape[1])
    return torch.stack([p[:, :, queries, queries - 1].mean((0, 2)) for p in patterns(model, tokens_BP)])


@torch.no_grad()
def repeated_copy_losses(model: Decoder, seq_len: int = 50, batch: int = 16, seed: int = 0,
                         ablate: Optional[dict[int, list[int]]] = None) -> dict[str, float]:
    """Mean loss on predicting the first copy's tokens 2..S and the second copy's tokens 2..S.

    The first token of each copy is excluded: it cannot be predicted in the first copy and it
    is the one token of the second copy that needs no induction.

    Example:
        >>> repeated_copy_losses(model)   # doctest: +SKIP
        {'first_copy': 7.9, 'second_copy': 1.2}
    """
    tokens = repeated_random_tokens(model.cfg.d_vocab, seq_len, batch, seed)
    loss_BP = model.run_with_hooks(tokens, return_type="loss", loss_per_token=True,
                                   fwd_hooks=_zero_heads_hooks(ablate))
    # loss_BP[:, j] predicts token j + 1; the first copy is tokens 1..S, the second S+1..2S.
    return {"first_copy": loss_BP[:, 1:seq_len].mean().item(),
            "second_copy": loss_BP[:, seq_len + 1:].mean().item()}


@torch.no_grad()
def expert_choices(model: Decoder, tokens_BP: Int[Tensor, "batch pos"]) -> list[Int[Tensor, "batch pos k"]]:
    """Each MoE layer's chosen expert ids per token.

    Example:
        >>> expert_choices(moe_model, tokens)[0].shape   # doctest: +SKIP
    """
    found: dict[int, Tensor] = {}

    def keep(indices_BPk: Tensor, hook) -> None:
        found[int(hook.name.split(".")[1])] = indices_BPk.detach()

    model.run_with_hooks(tokens_BP, return_type=None,
                         fwd_hooks=[(f"blocks.{l}.mlp.hook_expert_indices", keep) for l in range(model.cfg.n_layers)])
    return [found[l] for l in range(model.cfg.n_layers)]


def expert_load(model: Decoder, tokens_BP: Int[Tensor, "batch pos"]) -> Float[Tensor, "n_layers n_experts"]:
    """Fraction of tokens for which each expert is among the chosen k, per layer (rows sum to k).

    Example:
        >>> expert_load(moe_model, tokens).sum(-1)   # doctest: +SKIP
        tensor([2., 2.])
    """
    E = model.cfg.num_experts
    loads = []
    for indices_BPk in expert_choices(model, tokens_BP):
        chosen_NE = torch.nn.functional.one_hot(indices_BPk.flatten(0, 1), E).sum(1).clamp(max=1)
        loads.append(chosen_NE.float().mean(0))
    return torch.stack(loads)


def top_expert_predictability(model: Decoder, tokens_BP: Int[Tensor, "batch pos"]) -> dict[str, list[float]]:
    """How well the token id, vs the position alone, predicts each layer's top-1 expert on unseen rows.

    The first half of the rows fits a lookup table (the most common top expert for each token
    id, or for each position; the overall most common one for ids it never saw); the second
    half scores it. Routing by content shows as "by_token" accuracy far above "by_position".

    Example:
        >>> top_expert_predictability(moe_model, tokens)   # doctest: +SKIP
        {'by_token': [0.8, 0.7], 'by_position': [0.4, 0.4]}
    """
    half = tokens_BP.shape[0] // 2
    positions_BP = torch.arange(tokens_BP.shape[1]).expand_as(tokens_BP)
    result: dict[str, list[float]] = {"by_token": [], "by_position": []}
    for indices_BPk in expert_choices(model, tokens_BP):
        top_BP = indices_BPk[..., 0]
        for key, groups_BP in (("by_token", tokens_BP), ("by_position", positions_BP)):
            counts_GE = torch.zeros(int(groups_BP.max()) + 1, model.cfg.num_experts)
            fit_groups, fit_top = groups_BP[:half].flatten(), top_BP[:half].flatten()
            counts_GE.index_put_((fit_groups, fit_top), torch.ones(fit_top.numel()), accumulate=True)
            guess_G = counts_GE.argmax(-1)
            guess_G[counts_GE.sum(-1) == 0] = counts_GE.sum(0).argmax()  # unseen: overall favourite
            hits = guess_G[groups_BP[half:]] == top_BP[half:]
            result[key].append(hits.float().mean().item())
    return result
