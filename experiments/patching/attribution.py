"""Attribution patching: the gradient-based LINEAR APPROXIMATION of exact patching (Nanda, "Attribution
Patching"), every site at once from one clean forward, one corrupted forward and one backward pass.

Legend: B batch, P position, H n_heads, K d_head, D d_model.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from experiments._tokens import TokensLike, str_tokens
from experiments.metrics import MetricLike, PositionSelector, TokenIds, per_prompt_table, require_per_prompt_values
from experiments.patching.pairs import patching_run
from workbench.errors import InputError

SITES = {"resid": "hook_resid_pre", "attn": "hook_attn_out", "mlp": "hook_mlp_out", "heads": "attn.hook_z"}


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
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> approx = attribution_patching(model, tokens, corrupt, " s", " and", sites=["heads"])
        >>> approx.columns.tolist(), len(approx)        # one row per head (2 layers x 4 heads)
        (['site', 'layer', 'position', 'head', 'attribution'], 8)
    """
    unknown = sorted(set(sites) - set(SITES))
    if unknown:
        raise InputError(f"unknown attribution site(s) {unknown}; choose from {sorted(SITES)}")
    sites = [s for s in sites if not (s == "mlp" and model.cfg.attn_only)]
    run = patching_run(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, False, metric, position,
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

