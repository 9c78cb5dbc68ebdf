"""A neuron's top-activating windows over the bundled corpus, computed once per MLP for all its neurons and
cached on disk: the corpus-window engine (``experiments.corpus_windows``) scanning an MLP's neurons, keeping
each window's maximum (the package docstring, ``experiments.neurons``, says how)."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from experiments._progress import ProgressArg
from experiments._tokens import str_tokens
from experiments.corpus_windows import (CACHE_ENV, UnitSource, bundled_windows, cache_directory, scan_corpus,
                                        scan_path, weights_digest)
from experiments.neurons.units import MLPUnit, unit_activations
from workbench.errors import InputError

__all__ = ["CACHE_ENV", "CorpusMaxima", "WindowMaxima", "cache_directory", "corpus_maxima", "maxima_path",
           "mlp_source", "neuron_corpus", "top_windows", "weights_digest"]

neuron_corpus = bundled_windows  # the windows every corpus scan reads (the Neurons and Features pages' corpus)


@dataclass(frozen=True)
class CorpusMaxima:
    """Each corpus window's max activation of every neuron of one MLP, and where in the window it is.

    ``max_BM`` is -inf where no token of the window ran the neuron (a routed expert not chosen there).
    """

    windows_BP: Int[Tensor, "batch pos"]
    max_BM: Float[Tensor, "batch d_mlp"]
    argmax_BM: Int[Tensor, "batch d_mlp"]
    path: Optional[Path]
    from_disk: bool


class WindowMaxima:
    """The engine's reducer for neurons: every window's maximum of every unit past BOS and where it is (NaN, a
    unit that did not run, counts as -inf).

    Example:
        >>> maxima = WindowMaxima(width=2)
        >>> maxima.add(0, torch.tensor([[[1.0, float("nan")], [3.0, float("nan")]]]), skip=1)
        >>> maxima.tensors()
        {'max_BM': tensor([[3., -inf]]), 'argmax_BM': tensor([[2, 1]])}
    """

    key = {"statistic": "window-maxima"}

    def __init__(self, width: int):
        self.width = width
        self.maxima: list[Tensor] = []
        self.argmaxima: list[Tensor] = []

    def add(self, start: int, acts_BPM: Tensor, skip: int) -> None:
        values_BM, where_BM = acts_BPM.nan_to_num(nan=-math.inf).max(dim=1)
        self.maxima.append(values_BM.cpu())
        self.argmaxima.append((where_BM + skip).cpu())

    def tensors(self) -> dict[str, Tensor]:
        return {"max_BM": torch.cat(self.maxima), "argmax_BM": torch.cat(self.argmaxima).long()}

    def check(self, stored: dict[str, Tensor], windows_BP: Tensor) -> bool:
        """Exactly its two tensors, the maxima floating-point [B, width] without NaN, the positions integers
        [B, width] inside the window (a -1 would silently index the window's last token)."""
        if set(stored) != {"max_BM", "argmax_BM"}:
            return False
        max_BM, argmax_BM = stored["max_BM"], stored["argmax_BM"]
        shape = (windows_BP.shape[0], self.width)
        if tuple(max_BM.shape) != shape or not max_BM.is_floating_point() or bool(max_BM.isnan().any()):
            return False
        if tuple(argmax_BM.shape) != shape or argmax_BM.dtype not in (torch.int32, torch.int64):
            return False
        return not argmax_BM.numel() or (0 <= int(argmax_BM.min()) and int(argmax_BM.max()) < windows_BP.shape[1])


def mlp_source(model, unit: MLPUnit) -> UnitSource:
    """The engine's unit source for ``unit``'s neurons (``unit_activations``: NaN where a routed expert did not run).

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)
        >>> source = mlp_source(moe_model, MLPUnit(1, expert=3))
        >>> source.kind, source.label, source.identity, source.width
        ('neurons', 'toy-moe-2l-L1 expert 3', {'unit': [1, 3, False]}, 256)
    """
    width = unit.width(model.cfg)
    return UnitSource("neurons", f"{model.cfg.model_name or 'model'}-{unit.label}",
                      {"unit": [unit.layer, unit.expert, unit.shared]}, width,
                      lambda: nullcontext(lambda tokens_BP: unit_activations(model, tokens_BP, unit)[0]))


def maxima_path(model, unit: MLPUnit, windows_BP: Tensor) -> Path:
    """The cache file of ``unit``'s maxima over ``windows_BP``: named by the model and MLP, keyed by a
    digest of the weights, the MLP, the window ids and the engine's format.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)
        >>> path = maxima_path(moe_model, MLPUnit(1, expert=3), neuron_corpus(moe_model, n_windows=16))
        >>> path.parent == cache_directory() / "neurons", path.suffix
        (True, '.safetensors')
    """
    return scan_path(model, mlp_source(model, unit), WindowMaxima(unit.width(model.cfg)), windows_BP)


def corpus_maxima(model, unit: MLPUnit, n_windows: int = 256, window: int = 64, batch_size: int = 16,
                  progress: ProgressArg = False, use_disk: bool = True, corpus: Optional[str] = None) -> CorpusMaxima:
    """Every neuron of ``unit``: its max activation in each window of ``corpus`` (``"english"``, ``"code"``, or
    None for the model's own: ``experiments.corpus_windows.bundled_windows``) and the position of that max,
    read from the disk cache when there (no forward pass), else computed ``batch_size`` windows at a
    time (``progress`` counts the windows) and saved.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> maxima = corpus_maxima(moe_model, MLPUnit(1, expert=3), n_windows=16, window=32, use_disk=False)
        >>> maxima.max_BM.shape, maxima.from_disk
        (torch.Size([16, 256]), False)
    """
    source = mlp_source(model, unit)
    scan = scan_corpus(model, source, WindowMaxima(source.width), n_windows, window, batch_size, progress, use_disk,
                       corpus)
    return CorpusMaxima(scan.windows_BP, scan.tensors["max_BM"], scan.tensors["argmax_BM"].long(), scan.path,
                        scan.from_disk)


def top_windows(model, maxima: CorpusMaxima, neuron: int, k: int = 10) -> pd.DataFrame:
    """The ``k`` windows where ``neuron`` peaks highest: DataFrame[rank, window, position, token,
    max_activation, text] (``position``: where in the window; ``text``: the whole window).

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> maxima = corpus_maxima(moe_model, MLPUnit(1, expert=3), n_windows=16, window=32, use_disk=False)
        >>> top = top_windows(moe_model, maxima, neuron=17, k=3)
        >>> list(top.columns), top["rank"].tolist()
        (['rank', 'window', 'position', 'token', 'max_activation', 'text'], [1, 2, 3])
        >>> bool(top.max_activation.is_monotonic_decreasing)
        True
    """
    if not 0 <= neuron < maxima.max_BM.shape[1]:
        raise InputError(f"neuron must be in 0..{maxima.max_BM.shape[1] - 1}, got {neuron}")
    values_B = maxima.max_BM[:, neuron]
    ran = int(torch.isfinite(values_B).sum())
    top_values, top_windows_ = values_B.topk(min(k, ran))
    rows = []
    for rank, (value, w) in enumerate(zip(top_values.tolist(), top_windows_.tolist())):
        position = int(maxima.argmax_BM[w, neuron])
        window_tokens = str_tokens(model, maxima.windows_BP[w])
        rows.append({"rank": rank + 1, "window": w, "position": position, "token": window_tokens[position],
                     "max_activation": value, "text": "".join(window_tokens)})
    return pd.DataFrame(rows, columns=["rank", "window", "position", "token", "max_activation", "text"])
