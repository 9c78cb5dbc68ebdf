"""Every per-head score for a prompt set in one table, and composition scores between heads.

Legend: B batch, L n_layers, H n_heads, D d_model, K d_head, P position, S key position.

Composition scores follow TransformerLens (``all_composition_scores``; Elhage et al. 2021): for
an earlier head i and a later head j, ||OV_i @ C_j||_F / (||OV_i||_F ||C_j||_F) with C_j the
later head's QK circuit W_Q W_K^T (Q-composition), its transpose W_K W_Q^T (K-composition) or
its OV circuit W_V W_O (V-composition), in TransformerLens's row-vector convention. Scores for
pairs with layer_i >= layer_j are zero. The D x D circuits are never formed: each product is
V_i (O_i A_j) B_j with thin factors, and its norm equals that of the K x K core after QR-reducing
the outer factors.

``python -m experiments.heads --model NAME --out DIR [--prompt TEXT]``
The command line is ``experiments.cli.heads``.
"""

from __future__ import annotations

from typing import Literal, Optional

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from experiments._progress import ProgressArg
from workbench.tokens_api import TextOrTokens
from experiments.attention import head_statistics
from experiments.detectors import HEAD_KINDS, detection_patterns, score_patterns
from workbench.errors import InputError


@torch.no_grad()
def pattern_scores(model, tokens: TextOrTokens, exclude_bos: bool = False,
                   patterns_LHPS: Optional[Float[Tensor, "n_layers n_heads pos key_pos"]] = None,
                   ) -> dict[str, Float[Tensor, "n_layers n_heads"]]:
    """Induction, previous-token and duplicate-token ("mul") scores and mean entropy, from one forward pass.

    ``patterns_LHPS``: the patterns of a one-prompt ``tokens`` already computed
    (``experiments.attention.attention_patterns``), scored without running the model again.

    Example:
        >>> {name: tuple(scores.shape) for name, scores in pattern_scores(model, tokens).items()}   # [n_layers, n_heads]
        {'previous_token': (2, 4), 'duplicate_token': (2, 4), 'induction': (2, 4), 'entropy': (2, 4)}
        >>> from experiments.attention import attention_patterns
        >>> again = pattern_scores(model, tokens[:1], patterns_LHPS=attention_patterns(model, tokens[:1]))
        >>> torch.allclose(again["induction"], pattern_scores(model, tokens[:1])["induction"])
        True
    """
    tokens_BP = model.as_tokens(tokens)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    detections = {kind: detection_patterns(kind, tokens_BP) for kind in HEAD_KINDS}
    scores = {name: torch.zeros(L, H) for name in (*HEAD_KINDS, "entropy")}

    def score_layer(pattern_BHPS: Tensor, layer: int) -> None:
        for kind, detection in detections.items():
            scores[kind][layer] = score_patterns(pattern_BHPS, detection, exclude_bos=exclude_bos).cpu()
        scores["entropy"][layer] = head_statistics(pattern_BHPS)["entropy"].mean(0).cpu()  # batch in the layer slot

    if patterns_LHPS is not None:
        n_tokens = tokens_BP.shape[1]
        if tokens_BP.shape[0] != 1 or tuple(patterns_LHPS.shape) != (L, H, n_tokens, n_tokens):
            raise InputError(f"patterns of shape {tuple(patterns_LHPS.shape)} are not this model's for one prompt of "
                             f"{n_tokens} tokens ([{L}, {H}, {n_tokens}, {n_tokens}]; tokens {tuple(tokens_BP.shape)})")
        for layer in range(L):
            score_layer(patterns_LHPS[layer].unsqueeze(0), layer)
        return scores
    model.run_with_hooks(tokens_BP, return_type=None,
                         fwd_hooks=[(f"blocks.{l}.attn.hook_pattern", lambda p, hook: score_layer(p, hook.layer()))
                                    for l in range(L)])
    return scores


def head_scores_table(model, tokens: TextOrTokens, include_ablation: bool = True, progress: ProgressArg = True,
                      exclude_bos: bool = False,
                      patterns_LHPS: Optional[Float[Tensor, "n_layers n_heads pos key_pos"]] = None) -> pd.DataFrame:
    """DataFrame[layer, head, induction, previous_token, duplicate_token, entropy, ablation_delta].

    The three head-type scores are TransformerLens's "mul" detector scores on ``tokens``
    (averaged over the batch); entropy is the mean entropy (nats) of each query's attention;
    ablation_delta is the change in mean loss when the head is zero-ablated (NaN without
    ``include_ablation``). ``patterns_LHPS``: a one-prompt ``tokens``' patterns already computed
    (``pattern_scores``), for the scores without another forward pass.

    Example:
        >>> from experiments.induction import repeated_random_tokens
        >>> table = head_scores_table(model, repeated_random_tokens(model, 10, 2), progress=False)
        >>> table.nlargest(4, "induction")[["layer", "head"]].values.tolist()   # toy-attn-2l's induction heads
        [[1, 0], [1, 1], [1, 2], [1, 3]]
        >>> list(table.columns)
        ['layer', 'head', 'induction', 'previous_token', 'duplicate_token', 'entropy', 'ablation_delta']
    """
    from experiments.ablation import head_sweep

    tokens_BP = model.as_tokens(tokens)
    scores = pattern_scores(model, tokens_BP, exclude_bos, patterns_LHPS)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    table = pd.DataFrame({"layer": np.repeat(np.arange(L), H), "head": np.tile(np.arange(H), L),
                          "induction": scores["induction"].reshape(-1).numpy(),
                          "previous_token": scores["previous_token"].reshape(-1).numpy(),
                          "duplicate_token": scores["duplicate_token"].reshape(-1).numpy(),
                          "entropy": scores["entropy"].reshape(-1).numpy()})
    if include_ablation and tokens_BP.shape[1] >= 2:
        table["ablation_delta"] = head_sweep(model, tokens_BP, "loss", "zero", progress=progress)["delta"].values
    else:
        table["ablation_delta"] = np.nan
    return table


def _thin_r(factor: Tensor) -> Tensor:
    """R of a reduced QR of ``factor`` [..., D, K]: ||factor @ X||_F == ||R @ X||_F for any X."""
    return torch.linalg.qr(factor.double(), mode="reduced").R


@torch.no_grad()
def composition_scores(model, kind: Literal["Q", "K", "V"] = "Q") -> Float[Tensor, "n_layers n_heads n_layers n_heads"]:
    """scores[l1, h1, l2, h2]: how much head (l1, h1)'s output is read by head (l2, h2)'s query, key or value.

    Example:
        >>> k_comp = composition_scores(model, "K")
        >>> k_comp[0, :, 1, :].shape, bool(k_comp[1].eq(0).all())   # layer-0 heads feeding layer-1 keys; none later
        (torch.Size([4, 4]), True)
        >>> bool(k_comp[0, :, 1, :].gt(0).all() and k_comp[0, :, 1, :].le(1).all())
        True
    """
    if kind not in ("Q", "K", "V"):
        raise InputError(f"composition kind must be 'Q', 'K' or 'V', got {kind!r}")
    # The model's stacks: latent attention, which has no per-head W_Q/W_K/W_V, is an InputError naming it.
    W_Q, W_K, W_V = model.W_Q.double(), model.W_K.double(), model.W_V.double()  # [L, H, D, K]
    W_O = model.W_O.double()  # [L, H, K, D]
    # Left circuit OV_i = V_i O_i; right circuit A_j B_j with A [D, K], B [K, D].
    A, B_T = {"Q": (W_Q, W_K), "K": (W_K, W_Q), "V": (W_V, W_O.transpose(-1, -2))}[kind]
    R_left = _thin_r(W_V)  # [L, H, r, K]
    R_right = _thin_r(B_T)  # [L, H, r, K]: B = R_right^T Q^T
    left_norm = (R_left @ W_O).flatten(-2).norm(dim=-1)  # ||V_i O_i||
    right_norm = (A @ R_right.transpose(-1, -2)).flatten(-2).norm(dim=-1)  # ||A_j B_j||
    L, H = W_Q.shape[:2]
    scores = torch.zeros(L, H, L, H, dtype=torch.float64)
    for l2 in range(1, L):
        core = torch.einsum("ahkd,jde->ahjke", W_O[:l2], A[l2])  # O_i A_j: [l2, H_i, H_j, K, K]
        product = R_left[:l2, :, None] @ core @ R_right[l2][None, None].transpose(-1, -2)
        scores[:l2, :, l2, :] = product.flatten(-2).norm(dim=-1) / (left_norm[:l2, :, None] * right_norm[l2][None, None])
    return scores.float()




if __name__ == "__main__":  # the command line lives in experiments.cli.heads
    from experiments._cli import run_command

    run_command("heads")
