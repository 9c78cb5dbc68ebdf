"""Attribution patching, by what it is: the gradient-based estimate (a LINEAR APPROXIMATION) of exact patching
(Nanda, "Attribution Patching"), every site at once from one clean forward, one corrupted forward and one
backward pass (gradients from ``experiments.gradients``). Its public name stays TransformerLens's:
``attribution_patching``.

Legend: B batch, P position, H n_heads, K d_head, D d_model.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import torch

from experiments._tokens import str_tokens
from experiments.gradients import capturing_gradients
from experiments.metrics import per_prompt_table, require_per_prompt_values
from experiments.patching.pairs import PairedPrompts, takes_pairs
from workbench.errors import InputError

SITES = {"resid": "hook_resid_pre", "attn": "hook_attn_out", "mlp": "hook_mlp_out", "heads": "attn.hook_z"}


@takes_pairs("tokens")
def attribution_patching(model, pairs: PairedPrompts, sites: Sequence[str] = ("resid", "attn", "mlp", "heads"), *,
                         per_prompt: bool = False) -> pd.DataFrame:
    """APPROXIMATE patching effects of every site from one clean forward, one corrupted forward and one backward.

    attribution = sum over the site's elements of (clean - corrupt) * d metric / d activation,
    evaluated at the corrupted run, averaged over prompts: a first-order estimate of exact
    patching's ``delta``. Returns DataFrame[site, layer, position, head, attribution] where site is
    "resid" (hook_resid_pre), "attn", "mlp" (per position; head = -1) or "heads" (hook_z summed over
    positions; position = -1), with a ``prompt`` column under ``per_prompt=True``.
    ``df.attrs["method"]`` says it is an approximation; ``clean_metric`` / ``corrupt_metric`` (and their
    ``_per_prompt`` lists) hold the metric of the two unpatched runs. ``pairs`` as ``patch_heads`` (the older
    form too).

    Example:
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> pairs = PairedPrompts.from_prompts(model, tokens, corrupt, answers=" s", wrong=" and")
        >>> approx = attribution_patching(model, pairs, sites=["heads"])
        >>> approx.columns.tolist(), len(approx)        # one row per head (2 layers x 4 heads)
        (['site', 'layer', 'position', 'head', 'attribution'], 8)
    """
    unknown = sorted(set(sites) - set(SITES))
    if unknown:
        raise InputError(f"unknown attribution site(s) {unknown}; choose from {sorted(SITES)}")
    sites = [s for s in sites if not (s == "mlp" and model.cfg.attn_only)]
    names = [(site, layer, f"blocks.{layer}.{SITES[site]}") for site in sites for layer in range(model.cfg.n_layers)]
    wanted = {name for _, _, name in names}
    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(pairs.clean.tokens, attention_mask=pairs.clean.mask,
                                                         names_filter=lambda n: n in wanted)
        clean_R = pairs.metric.values(clean_logits, pairs.clean).float().cpu()
    with capturing_gradients(model, sorted(wanted)) as captured:
        logits = model(pairs.corrupt.tokens, attention_mask=pairs.corrupt.mask)
        values_R = pairs.metric.values(logits, pairs.corrupt)
        if per_prompt:
            require_per_prompt_values(len(values_R), pairs.corrupt.size, "attribution")
        grads = captured.gradients(values_R.mean())
    frames = []
    for site, layer, name in names:
        effect = (clean_cache[name] - captured.activations[name].detach()) * grads[name]
        if site == "heads":  # [B, P, H, K] -> [B, H]
            by_B_ = effect.sum((1, 3))
            index = {"position": -1, "head": np.arange(by_B_.shape[1])}
        else:  # [B, P, D] -> [B, P]
            by_B_ = effect.sum(2)
            index = {"position": np.arange(by_B_.shape[1]), "head": -1}
        frame = pd.DataFrame({"site": site, "layer": layer, **index})
        if per_prompt:  # the mean's gradient is 1/B of each prompt's: scale back to each prompt's own
            frame = per_prompt_table(frame, (by_B_ * by_B_.shape[0]).T.float().cpu(), pairs.corrupt.size, "attribution")
            frame = frame.rename(columns={"metric": "attribution"})
        else:
            frame["attribution"] = by_B_.sum(0).float().cpu().numpy()
        frames.append(frame)
    table = pd.concat(frames, ignore_index=True)[["site", "layer", "position", "head"] + (["prompt"] if per_prompt else [])
                                                + ["attribution"]]
    corrupt_R = values_R.detach().float().cpu()
    table.attrs.update(method="attribution patching (first-order linear approximation of activation patching)",
                       str_tokens=str_tokens(model, pairs.clean.tokens[0]), clean_metric=float(clean_R.mean()),
                       corrupt_metric=float(corrupt_R.mean()), clean_metric_per_prompt=clean_R.tolist(),
                       corrupt_metric_per_prompt=corrupt_R.tolist())
    return table

