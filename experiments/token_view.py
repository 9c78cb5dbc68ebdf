"""The values a token view colours the prompt by: the attention a selected token pays or gets, or any
per-token value (a neuron's activation, an ablation's loss change), one per position.

Legend: L n_layers, H n_heads, P position, S key position.

``experiments.plots.token_view.token_html`` draws them as coloured text, CircuitsVis-style.
"""

from __future__ import annotations

import math
from typing import Literal, Optional, Sequence

import pandas as pd
from jaxtyping import Float
from torch import Tensor

from experiments._tokens import as_floats
from workbench.errors import InputError

Direction = Literal["from_selected", "to_selected"]
DIRECTIONS: tuple[str, ...] = ("from_selected", "to_selected")
def selected_attention(patterns_LHPS: Float[Tensor, "n_layers n_heads pos key_pos"], layer: int, head: Optional[int],
                       token: int, direction: Direction = "from_selected") -> Float[Tensor, "pos"]:
    """The attention between the selected ``token`` and every position, for one head or (``head=None``)
    the mean over the layer's heads.

    ``"from_selected"``: what the selected token pays to each position (its row of the pattern: query
    ``token``, each key). ``"to_selected"``: what each position pays to the selected token (its column:
    each query, key ``token``). Positions the causal mask hides get 0.

    Example:
        >>> patterns_LHPS = torch.tensor([[[[1.0, 0.0], [0.25, 0.75]]]])
        >>> selected_attention(patterns_LHPS, 0, 0, 1).tolist(), selected_attention(patterns_LHPS, 0, 0, 0, "to_selected").tolist()
        ([0.25, 0.75], [1.0, 0.25])
    """
    n_layers, n_heads, n_pos = patterns_LHPS.shape[0], patterns_LHPS.shape[1], patterns_LHPS.shape[2]
    if not 0 <= layer < n_layers:
        raise InputError(f"layer must be in 0..{n_layers - 1}, got {layer}")
    if head is not None and not 0 <= head < n_heads:
        raise InputError(f"head must be in 0..{n_heads - 1} (or None for the mean over heads), got {head}")
    if not 0 <= token < n_pos:
        raise InputError(f"the selected token must be a position in 0..{n_pos - 1}, got {token}")
    if direction not in DIRECTIONS:
        raise InputError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    pattern_HPS = patterns_LHPS[layer] if head is None else patterns_LHPS[layer, head:head + 1]
    values_HP = pattern_HPS[:, token, :] if direction == "from_selected" else pattern_HPS[:, :, token]
    return values_HP.float().mean(0)


def token_values(str_tokens: Sequence[str], values, value_name: str = "value") -> pd.DataFrame:
    """The values beside their tokens, for a CSV: DataFrame[position, token, <value_name>].

    Example:
        >>> token_values(["a", "b"], [0.5, 1.0], "attention").columns.tolist()
        ['position', 'token', 'attention']
    """
    floats = as_floats(values)
    if len(floats) != len(str_tokens):
        raise InputError(f"token_values got {len(str_tokens)} tokens but {len(floats)} values")
    return pd.DataFrame({"position": range(len(floats)), "token": list(str_tokens), value_name: floats})


def per_position(df: pd.DataFrame, column: str, n_positions: int) -> list[float]:
    """A table with a ``position`` column as one value per position (NaN where it has no row), e.g. the
    per-token loss change of ``experiments.ablation.per_token_loss_change`` (no row for position 0).

    Example:
        >>> per_position(pd.DataFrame({"position": [1, 2], "delta": [0.5, -1.0]}), "delta", 3)
        [nan, 0.5, -1.0]
    """
    values = [math.nan] * n_positions
    for position, value in zip(df["position"], df[column]):
        values[int(position)] = float(value)
    return values


