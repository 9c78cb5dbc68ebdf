"""Special tokens (BOS, EOS, pad) on the pages: which positions of a prompt hold one, the colour-scale maximum
with them left out, and the one toggle that brings them back.

A BOS token is an attention sink and carries activations a hundred times those of other tokens (SmolLM2's SAE
features near 3,300 at BOS against at most 64 elsewhere), so a colour scale that includes it shows every other
token as blank, and a default that picks the largest value picks BOS. The pages leave these positions out of
colour scales and default selections unless the user turns the toggle on; the ids are
``experiments.sae.activations.special_token_ids`` (what SAE training's ``exclude_special_tokens`` leaves out).

Legend: P position.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np  # noqa: F401 - the docstring example's arrays
import streamlit as st
import torch

from app.url_state import linked
from experiments.sae.activations import special_token_ids

TOGGLE_KEY = "special_tokens"  # one key on every page: the choice follows the user, and lives in the link


def special_positions(model, ids: Sequence[int]) -> tuple[int, ...]:
    """The positions of ``ids`` whose token is one of the model's special tokens (BOS, EOS, pad).

    Example:
        >>> ids = model.to_tokens("The cat")[0].tolist()   # the zoo's tokenizer prepends BOS
        >>> special_positions(model, ids)
        (0,)
    """
    special = set(special_token_ids(model))
    return tuple(position for position, token in enumerate(ids) if int(token) in special)


def scale_max(values, special: Sequence[int], axes: Sequence[int], floor: float = 1e-6) -> float:
    """The largest of ``values`` (a tensor or an array) once the ``special`` positions are left out along each of
    ``axes`` (e.g. the query and key axes of attention patterns): the top of a colour scale that BOS does not wash
    out. The largest of all values when nothing is left; never below ``floor`` (a colour scale needs a width).
    NaN cells (a heatmap's empty ones) are skipped.

    Example:
        >>> pattern_PS = np.array([[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [0.7, 0.2, 0.1]])
        >>> round(scale_max(pattern_PS, special=(0,), axes=(0, 1)), 6)   # row 0 and column 0 left out
        0.2
        >>> scale_max(torch.tensor(pattern_PS), special=(), axes=(0, 1))
        1.0
    """
    values = torch.as_tensor(values)
    kept = values
    for axis in axes:
        keep = [p for p in range(values.shape[axis]) if p not in set(special)]
        kept = kept.index_select(axis, torch.tensor(keep, dtype=torch.long, device=values.device))
    top = _finite_max(kept)
    if top is None:
        top = _finite_max(values)
    return max(top if top is not None else floor, floor)


def _finite_max(values: torch.Tensor) -> float | None:
    finite = values[torch.isfinite(values)] if values.numel() else values
    return float(finite.max()) if finite.numel() else None


def show_special_toggle(where: str) -> bool:
    """The toggle that brings special tokens back into colour scales and default selections (off by default);
    linked under one key, so the choice made on one page holds on every page. ``where`` names what it changes.

    Example:
        >>> include = show_special_toggle("the colour scales")   # doctest: +SKIP
    """
    return bool(linked(st.toggle, "Include special tokens (BOS, pad)", value=False, key=TOGGLE_KEY,
                       help=f"Special tokens carry outsized values (BOS is an attention sink, with activations far "
                            f"above other tokens'); they are left out of {where} unless this is on."))
