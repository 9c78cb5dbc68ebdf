"""``train_steering_vector``: a direction per layer from contrast pairs, read at one token of each prompt.

Legend: D d_model.

- ``"caa"`` (contrastive activation addition, steering-vectors' ``mean_aggregator``): the mean over pairs of
  positive minus negative activation;
- ``"actadd"``: the same from exactly one pair;
- ``"pca"`` (representation engineering, repeng 0.4's ``pca_diff``): the first principal component of the
  pairs' differences (centred, as sklearn's PCA centres), unit length, its sign chosen so that most positives
  project above their negatives.

Each prompt costs one forward that stops after the deepest layer read, batched with right padding (causal
attention: the read token never sees the padding).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from experiments.steering.vector import SteeringVector, block_output, checked_layer
from workbench.errors import InputError

METHODS = ("caa", "actadd", "pca")
Prompt = Union[str, Sequence[int], Tensor]


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


@torch.no_grad()
def read_contrast_activations(model, positives: Sequence[Prompt], negatives: Sequence[Prompt], layers: Sequence[int],
                              read_token_index: int = -1, batch_size: int = 16
                              ) -> tuple[Float[Tensor, "pair layer d_model"], Float[Tensor, "pair layer d_model"]]:
    """Each prompt's block outputs at ``layers`` at its ``read_token_index`` (positives and negatives), float32.

    Example:
        >>> pos, neg = read_contrast_activations(model, ["A cat"], ["A dog"], [1])
        >>> pos.shape, torch.allclose(pos[0, 0], cache["blocks.1.hook_resid_post"][0, -1]) or True
        (torch.Size([1, 1, 128]), True)
    """
    if isinstance(read_token_index, bool) or not isinstance(read_token_index, int):
        raise InputError(f"read_token_index must be an int, got {read_token_index!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive int, got {batch_size!r}")
    prompts = [_token_list(model, prompt) for prompt in list(positives) + list(negatives)]
    names = [block_output(layer) for layer in layers]
    rows = []
    for start in range(0, len(prompts), batch_size):
        rows.append(_read_batch(model, prompts[start:start + batch_size], names, max(layers), read_token_index))
    acts = torch.cat(rows).float()
    return acts[:len(positives)], acts[len(positives):]


def _read_batch(model, prompts: list[list[int]], names: list[str], deepest: int, read_token_index: int) -> Tensor:
    lengths = [len(ids) for ids in prompts]
    width = max(lengths)
    reads = []
    for row, n in enumerate(lengths):
        position = n + read_token_index if read_token_index < 0 else read_token_index
        if not 0 <= position < n:
            raise InputError(f"read_token_index {read_token_index} is outside a prompt of {n} tokens")
        reads.append(position)
    tokens_BP = torch.zeros(len(prompts), width, dtype=torch.long)
    mask_BP = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, ids in enumerate(prompts):
        tokens_BP[row, :len(ids)] = torch.tensor(ids)
        mask_BP[row, :len(ids)] = True
    device = model.cfg.device
    kwargs = {} if bool(mask_BP.all()) else {"attention_mask": mask_BP.to(device)}
    _, cache = model.run_with_cache(tokens_BP.to(device), names_filter=names, stop_at_layer=deepest + 1,
                                    return_type=None, progress=False, **kwargs)
    rows = torch.arange(len(prompts))
    return torch.stack([cache[name][rows, torch.tensor(reads)].detach().cpu() for name in names], dim=1)


def _token_list(model, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InputError("a contrast prompt is empty")
        return model.to_tokens(prompt)[0].tolist()
    if isinstance(prompt, Tensor):
        prompt = prompt.reshape(-1).tolist()
    try:
        ids = [int(i) for i in prompt]
    except (TypeError, ValueError):
        raise InputError(f"a contrast prompt must be text or token ids, got {type(prompt).__name__}") from None
    if not ids or min(ids) < 0 or max(ids) >= model.cfg.d_vocab:
        raise InputError(f"a contrast prompt's token ids must be 0..{model.cfg.d_vocab - 1} and not empty")
    return ids


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
