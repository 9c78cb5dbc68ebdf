"""The Steering page's computations (``app/pages/16_Steering.py`` lays out only): contrast pairs parsed from the
text box, a vector trained from them or read from a saved file, the clean and steered continuations and the
coefficient sweep. Each runs under the model's lock (its hooks are on only for the call); the page keeps each
result in the session under the settings that made it, so a rerun with the same settings draws without
recomputing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from app.state import LoadedModel
from experiments.continuations import Continuations
from experiments.steering import (SteeringVector, coefficient_sweep, continue_with_vector, logit_difference,
                                  token_probability, train_steering_vector)
from workbench.errors import InputError

MAX_PAIRS = 64          # what the page trains from: 128 forwards at most
MAX_SWEEP_POINTS = 41
DEFAULT_PAIRS = ("I love this, it is wonderful | I hate this, it is awful\n"
                 "What a great day | What a terrible day\n"
                 "She was happy and kind | She was sad and cruel")
MEASURES = ("logit difference", "token probability")


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """One pair per line, ``positive | negative``; blank lines skipped.

    Example:
        >>> parse_pairs("good | bad\\n\\n nice|mean ")
        [('good', 'bad'), ('nice', 'mean')]
        >>> parse_pairs("only one side")
        Traceback (most recent call last):
        workbench.errors.InputError: line 1 has no '|': write each pair as positive | negative (a vector needs both classes)
    """
    pairs = []
    for number, line in enumerate(str(text).splitlines(), start=1):
        if not line.strip():
            continue
        if "|" not in line:
            raise InputError(f"line {number} has no '|': write each pair as positive | negative "
                             "(a vector needs both classes)")
        positive, negative = (side.strip() for side in line.split("|", 1))
        if not positive or not negative:
            raise InputError(f"line {number} has an empty side: both the positive and the negative prompt are needed")
        pairs.append((positive, negative))
    if not pairs:
        raise InputError("no pairs: write at least one line positive | negative")
    if len(pairs) > MAX_PAIRS:
        raise InputError(f"{len(pairs)} pairs; the page trains from at most {MAX_PAIRS}")
    return pairs


def vector_from_pairs(loaded: LoadedModel, pairs: Sequence[tuple[str, str]], method: str, layers: Sequence[int],
                      read_token_index: int = -1) -> SteeringVector:
    """``train_steering_vector`` on the open model.

    Example:
        >>> vector = vector_from_pairs(LoadedModel(model, "toy"), [("A cat", "A dog")], "caa", [1])
        >>> sorted(vector.layer_activations)
        [1]
    """
    with loaded.lock:
        return train_steering_vector(loaded.model, list(pairs), layers=list(layers), read_token_index=read_token_index,
                                     method=method)


def vector_from_file(path: str) -> SteeringVector:
    """A saved vector: a folder ``SteeringVector.save`` wrote, or a control-vector ``.gguf``.

    Example:
        >>> import tempfile
        >>> folder = SteeringVector({0: torch.ones(128)}).save(tempfile.mkdtemp())
        >>> sorted(vector_from_file(str(folder)).layer_activations)
        [0]
    """
    where = Path(str(path).strip()).expanduser()
    if where.suffix.lower() == ".gguf":
        return SteeringVector.import_gguf(where)
    return SteeringVector.load(where)


def continuations(loaded: LoadedModel, vector: SteeringVector, ids: tuple[int, ...], coefficient: float,
                  max_new_tokens: int) -> Continuations:
    """The greedy continuation of the prompt, clean and steered.

    Example:
        >>> result = continuations(LoadedModel(model, "toy"), SteeringVector({0: torch.zeros(128)}),
        ...                        tuple(tokens[0].tolist()), 4.0, 3)
        >>> result.clean_tokens == result.ablated_tokens   # a zero vector changes nothing
        True
    """
    with loaded.lock:
        return continue_with_vector(loaded.model, vector, torch.tensor([ids]), coefficient, max_new_tokens)


def coefficients(low: float, high: float, points: int) -> list[float]:
    """``points`` evenly spaced coefficients from ``low`` to ``high`` (0 always among them: the clean reference).

    Example:
        >>> coefficients(-2.0, 2.0, 5), coefficients(1.0, 3.0, 3)
        ([-2.0, -1.0, 0.0, 1.0, 2.0], [0.0, 1.0, 2.0, 3.0])
    """
    if not 2 <= int(points) <= MAX_SWEEP_POINTS:
        raise InputError(f"the sweep takes 2..{MAX_SWEEP_POINTS} points, got {points}")
    if not high > low:
        raise InputError(f"the sweep's highest coefficient ({high}) must be above its lowest ({low})")
    values = sorted({round(float(v), 6) for v in np.linspace(low, high, int(points))} | {0.0})
    return values


def sweep(loaded: LoadedModel, vector: SteeringVector, ids: tuple[int, ...], measure: str, tokens: Sequence[str],
          values: Sequence[float]) -> pd.DataFrame:
    """``coefficient_sweep`` of the prompt: "logit difference" (the first token's logit minus the second's) or
    "token probability" (the tokens' summed probability), next after the prompt.

    Example:
        >>> table = sweep(LoadedModel(model, "toy"), SteeringVector({0: torch.ones(128)}), tuple(tokens[0].tolist()),
        ...               "logit difference", [" on", " the"], [0.0, 1.0])
        >>> table.coefficient.tolist()
        [0.0, 1.0]
    """
    if measure == "logit difference":
        if len(tokens) != 2:
            raise InputError("the logit difference needs two tokens: the one to promote and the one to compare with")
        measured = logit_difference(tokens[0], tokens[1])
    elif measure == "token probability":
        measured = token_probability(list(tokens))
    else:
        raise InputError(f"measure must be one of {MEASURES}, got {measure!r}")
    with loaded.lock:
        return coefficient_sweep(loaded.model, vector, torch.tensor([ids]), measured, list(values))
