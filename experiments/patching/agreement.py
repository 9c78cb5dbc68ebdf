"""How well attribution patching estimates exact patching: the two side by side, their correlation and sign agreement."""

from __future__ import annotations

import numpy as np
import pandas as pd

from experiments._progress import ProgressArg
from experiments.patching.exact import patch_heads
from experiments.patching.gradient_estimate import attribution_patching
from experiments.patching.pairs import PairedPrompts, takes_pairs
from workbench.errors import InputError


@takes_pairs("tokens")
def compare_attribution_to_exact(model, pairs: PairedPrompts, progress: ProgressArg = False,
                                 **options) -> tuple[pd.DataFrame, float]:
    """Per-head exact patching delta beside its attribution estimate, and their Pearson correlation.

    ``pairs`` as ``patch_heads`` (the older form too); ``options``: ``per_prompt``.

    Example:
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")
        >>> pairs = PairedPrompts.from_prompts(model, tokens, corrupt, answers=" s", wrong=" and")
        >>> table, r = compare_attribution_to_exact(model, pairs)
        >>> table.columns.tolist()
        ['layer', 'head', 'metric', 'delta', 'normalized', 'attribution']
        >>> round(r, 2)                                 # attribution tracks exact patching closely here
        0.99
    """
    exact = patch_heads(model, pairs, progress, **options)
    approx = attribution_patching(model, pairs, sites=["heads"], **options)
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

