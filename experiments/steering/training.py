"""``train_steering_vector``: a direction per layer from contrast pairs, read at one token of each prompt.

Legend: D d_model.

- ``"caa"`` (contrastive activation addition, steering-vectors' ``mean_aggregator``): the mean over pairs of
  positive minus negative activation;
- ``"actadd"``: the same from exactly one pair;
- ``"pca"`` (representation engineering, repeng 0.4's ``pca_diff``): the first principal component of the
  pairs' differences (centred, as sklearn's PCA centres), unit length, its sign chosen so that most positives
  project above their negatives.

Each prompt costs one forward that stops after the deepest layer read, batched with right padding (causal
attention: the read token never sees the padding): ``experiments._hook_rows``, the reader probes share.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from experiments._hook_rows import Prompt, hook_rows
from experiments.steering.vector import SteeringVector, block_output, checked_layer
from workbench.errors import InputError

METHODS = ("caa", "actadd", "pca")


def train_steering_vector(model, pairs: Sequence, layers: Optional[Sequence[int]] = None,
                          read_token_index: int = -1, method: str = "caa", batch_size: int = 16) -> SteeringVector:
    """The steering vector of ``pairs`` (``(positive, negative)`` tuples of text or token ids, or objects with
    ``positive_str`` / ``negative_str`` as steering-vectors' samples, or ``positive`` / ``negative`` as repeng's)
    at ``layers`` (default: every block), each prompt read at ``read_token_index``.

    Example:
        >>> pairs = [("The cat sat on the mat", "The dog sat on the mat"), ("A cat", "A dog")]
        >>> vector = train_steering_vector(model, pairs, layers=[0, 1])
        >>> sorted(vector.layer_activations), vector.layer_activations[1].shape, vector.meta["method"]
        ([0, 1], torch.Size([128]), 'caa')
    """
    if method not in METHODS:
        raise InputError(f"method must be one of {METHODS}, got {method!r}")
    positives, negatives = _split_pairs(pairs)
    if method == "actadd" and len(positives) != 1:
        raise InputError(f"actadd takes exactly one pair, got {len(positives)}; use method='caa' for several")
    if method == "pca" and len(positives) < 2:
        raise InputError(f"pca needs at least 2 pairs (it finds the main axis of their differences), got {len(positives)}")
    layer_list = _checked_layers(model, layers)
    pos_acts, neg_acts = read_contrast_activations(model, positives, negatives, layer_list, read_token_index, batch_size)
    directions = {}
    for i, layer in enumerate(layer_list):
        diffs = pos_acts[:, i] - neg_acts[:, i]
        directions[layer] = (_pca_direction(diffs, pos_acts[:, i], neg_acts[:, i], layer) if method == "pca"
                             else diffs.mean(dim=0))
    meta = {"method": method, "layers": layer_list, "read_token_index": int(read_token_index), "n_pairs": len(positives)}
    return SteeringVector(directions, meta=meta)


def read_contrast_activations(model, positives: Sequence[Prompt], negatives: Sequence[Prompt], layers: Sequence[int],
                              read_token_index: int = -1, batch_size: int = 16
                              ) -> tuple[Float[Tensor, "pair layer d_model"], Float[Tensor, "pair layer d_model"]]:
    """Each prompt's block outputs at ``layers`` at its ``read_token_index`` (positives and negatives), float32
    (read by ``experiments._hook_rows``, the engine probes use too).

    Example:
        >>> pos, neg = read_contrast_activations(model, ["A cat"], ["A dog"], [1])
        >>> pos.shape, torch.allclose(pos[0, 0], cache["blocks.1.hook_resid_post"][0, -1]) or True
        (torch.Size([1, 1, 128]), True)
    """
    if isinstance(read_token_index, bool) or not isinstance(read_token_index, int):
        raise InputError(f"read_token_index must be an int, got {read_token_index!r}")
    names = [block_output(layer) for layer in layers]
    rows = hook_rows(model, list(positives) + list(negatives), names, read_token_index, batch_size,
                     reading_name="read_token_index")
    acts = torch.stack([rows[name] for name in names], dim=1)
    return acts[:len(positives)], acts[len(positives):]


def _split_pairs(pairs: Sequence) -> tuple[list, list]:
    if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__len__"):
        raise InputError("pairs must be a list of (positive, negative) prompts")
    positives, negatives = [], []
    for i, pair in enumerate(pairs):
        if hasattr(pair, "positive_str"):      # steering-vectors' SteeringVectorTrainingSample
            pair = (pair.positive_str, pair.negative_str)
        elif hasattr(pair, "positive"):        # repeng's DatasetEntry
            pair = (pair.positive, pair.negative)
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise InputError(f"pair {i} must be (positive, negative), got {pair!r}; a vector needs both classes, "
                             "a positive and a negative prompt in each pair")
        positives.append(pair[0])
        negatives.append(pair[1])
    if not positives:
        raise InputError("pairs is empty; a steering vector needs at least one (positive, negative) pair")
    return positives, negatives


def _checked_layers(model, layers: Optional[Sequence[int]]) -> list[int]:
    if layers is None:
        return list(range(model.cfg.n_layers))
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    checked = sorted({checked_layer(model, layer) for layer in layers})
    if not checked:
        raise InputError("layers is empty; give at least one block index (or None for every block)")
    return checked


def _pca_direction(diffs: Tensor, pos: Tensor, neg: Tensor, layer: int) -> Float[Tensor, "d_model"]:
    centred = (diffs - diffs.mean(dim=0)).double()
    if float(centred.abs().max()) == 0.0:
        raise InputError(f"layer {layer}: every pair's difference is the same, so it has no principal axis; use "
                         "method='caa'")
    direction_D = torch.linalg.svd(centred, full_matrices=False).Vh[0].float()
    # repeng's sign: the positive above its negative in most pairs (ties keep the component's sign)
    above = ((pos @ direction_D) > (neg @ direction_D)).float().mean()
    below = ((pos @ direction_D) < (neg @ direction_D)).float().mean()
    return -direction_D if below > above else direction_D
