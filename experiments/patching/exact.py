"""Exact activation patching: each site of the corrupted run replaced by the clean run's, every site scored in
batched passes that reuse the corrupted run up to the site's layer (``experiments._batched``).

Legend: B batch, P position, L n_layers, H n_heads.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from experiments._batched import Edit, score_edits, unedited_run
from experiments._progress import ProgressArg
from experiments._tokens import str_tokens
from experiments.metrics import per_prompt_table
from experiments.patching.pairs import PairedPrompts, takes_pairs
from experiments.sites import Site


def _exact(model, pairs: PairedPrompts, sites: Sequence[Site], labels: pd.DataFrame, desc: str, per_prompt: bool,
           progress: ProgressArg) -> pd.DataFrame:
    """Scores patching each site; ``labels`` holds the result's identifying columns, one row per site."""
    hook_names = sorted({site.hook_name for site in sites})
    clean_R, _, clean_acts = unedited_run(model, pairs.clean, pairs.metric, hook_names)
    corrupt_R, corrupt_resid, _ = unedited_run(model, pairs.corrupt, pairs.metric)
    edits = [Edit(site, clean_acts[site.hook_name]) for site in sites]
    values_nR = score_edits(model, corrupt_resid, pairs.corrupt, edits, pairs.metric, progress, desc=desc)
    labels = labels.reset_index(drop=True)
    if per_prompt:
        table = per_prompt_table(labels, values_nR, pairs.size, "patching")
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
                       str_tokens=str_tokens(model, pairs.clean.tokens[0]))
    return table


_RUN_DOC = """``pairs``: a ``PairedPrompts`` (``PairedPrompts.from_prompts``: texts or token ids, answer and wrong
    tokens for the logit difference at each row's last real token, or a ``metric=``). The older form
    (``clean_tokens, corrupt_tokens, answer_token, wrong_token`` and the keywords ``metric``, ``position``,
    ``clean_mask``, ``corrupt_mask``, ``padding_side``) is still taken. Values are means over prompts;
    ``per_prompt=True`` returns a ``prompt`` column instead."""


@takes_pairs("tokens")
def patch_residual(model, pairs: PairedPrompts, progress: ProgressArg = True, *,
                   per_prompt: bool = False) -> pd.DataFrame:
    """Patches the residual stream entering each layer at each position: DataFrame[layer, position, metric, delta, normalized].

    {run}

    Example:
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")   # ``tokens`` with its last token changed
        >>> pairs = PairedPrompts.from_prompts(model, tokens, corrupt, answers=" s", wrong=" and")
        >>> df = patch_residual(model, pairs, progress=False)
        >>> df.nlargest(2, "normalized").round(2)       # the changed position, patched, restores the clean run
            layer  position  metric  delta  normalized
        13      0        13    0.55   1.61         1.0
        27      1        13    0.55   1.61         1.0
    """
    P = pairs.clean.tokens.shape[1]
    labels = pd.DataFrame([(l, p) for l in range(model.cfg.n_layers) for p in range(P)], columns=["layer", "position"])
    sites = [Site(f"blocks.{l}.hook_resid_pre", position=p) for l, p in labels.itertuples(index=False)]
    return _exact(model, pairs, sites, labels, "patch residual", per_prompt, progress)


@takes_pairs("tokens")
def patch_attn_mlp(model, pairs: PairedPrompts, progress: ProgressArg = True, *,
                   per_prompt: bool = False) -> pd.DataFrame:
    """Patches each layer's attention and MLP output at each position: DataFrame[component, layer, position, metric, delta, normalized].

    {run}

    Example:
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> df = patch_attn_mlp(model, tokens, corrupt, " s", " and", progress=False)    # the older form
        >>> df["component"].unique().tolist(), len(df)     # toy-attn-2l has no MLP: 2 layers x 14 positions
        (['attn'], 28)
    """
    P = pairs.clean.tokens.shape[1]
    components = ["attn"] + ([] if model.cfg.attn_only else ["mlp"])
    labels = pd.DataFrame([(c, l, p) for c in components for l in range(model.cfg.n_layers) for p in range(P)],
                          columns=["component", "layer", "position"])
    sites = [Site(f"blocks.{l}.hook_{c}_out", position=p) for c, l, p in labels.itertuples(index=False)]
    return _exact(model, pairs, sites, labels, "patch attn/mlp", per_prompt, progress)


@takes_pairs("tokens")
def patch_heads(model, pairs: PairedPrompts, progress: ProgressArg = True, *, per_prompt: bool = False) -> pd.DataFrame:
    """Patches each head's output (hook_z, all positions): DataFrame[layer, head, metric, delta, normalized].

    {run}

    Example:
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> pairs = PairedPrompts.from_prompts(model, tokens, corrupt, answers=" s", wrong=" and")
        >>> patch_heads(model, pairs, progress=False).nlargest(2, "normalized")[["layer", "head"]]
           layer  head
        5      1     1
        1      0     1
    """
    labels = pd.DataFrame([(l, h) for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)],
                          columns=["layer", "head"])
    sites = [Site(f"blocks.{l}.attn.hook_z", index=h) for l, h in labels.itertuples(index=False)]
    return _exact(model, pairs, sites, labels, "patch heads", per_prompt, progress)


for _function in (patch_residual, patch_attn_mlp, patch_heads):
    _function.__doc__ = _function.__doc__.replace("{run}", _RUN_DOC)
