"""Every feature of an SAE over the bundled corpus in one pass: its top-activating windows (a running top-k per
feature, so memory stays bounded by ``k`` x ``d_sae`` plus one batch) and its activation-density histogram,
cached on disk and distrusted on the way back (the package docstring, ``experiments.features``, says how).

Legend: W windows kept per feature, X d_sae.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from experiments._progress import ProgressArg
from experiments._tokens import str_tokens
from experiments.corpus_windows import UnitSource, cache_directory, scan_corpus, scan_path, weights_digest
from experiments.features.activations import check_feature, reading_features, run_features
from workbench.errors import InputError
from workbench.sae import SAE

# The density histogram's bins: log10 of a positive activation, 1e-5 .. 1e3 in 0.2 steps; values outside
# fall in the first or last bin (a fixed grid, so a one-pass count needs no second look at the data).
LOG10_RANGE = (-5.0, 3.0)
N_BINS = 40
TENSORS = {"top_values_WX", "top_windows_WX", "top_positions_WX", "histogram_XZ", "n_tokens"}


def bin_edges() -> Float[Tensor, "n_bins_plus_1"]:
    """The density histogram's bin edges in log10 of the activation (``N_BINS`` + 1 of them).

    Example:
        >>> edges = bin_edges(); len(edges), float(edges[0]), float(edges[-1])
        (41, -5.0, 3.0)
    """
    return torch.linspace(*LOG10_RANGE, N_BINS + 1, dtype=torch.float64)


@dataclass(frozen=True)
class FeatureStats:
    """What one pass over the corpus found for every feature of an SAE.

    ``top_values_WX[r, f]`` is feature f's r-th highest window maximum (descending), in window
    ``top_windows_WX[r, f]`` at position ``top_positions_WX[r, f]``; ``histogram_XZ[f, h]`` counts the
    tokens where f's activation is positive with log10 in bin h of ``bin_edges()``; ``n_tokens`` tokens
    were read (BOS left out).
    """

    windows_BP: Int[Tensor, "batch pos"]
    top_values_WX: Float[Tensor, "W X"]
    top_windows_WX: Int[Tensor, "W X"]
    top_positions_WX: Int[Tensor, "W X"]
    histogram_XZ: Int[Tensor, "d_sae n_bins"]
    n_tokens: int
    path: Optional[Path]
    from_disk: bool

    @property
    def density_X(self) -> Float[Tensor, "d_sae"]:
        """The fraction of the corpus's tokens where each feature fires (is positive)."""
        return self.histogram_XZ.sum(1).double() / max(self.n_tokens, 1)


def sae_digest(sae: SAE) -> str:
    """SHA-256 of the SAE's weights and its configuration (what decides its activations).

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=2, d_sae=3)); len(sae_digest(sae))
        64
    """
    config = json.dumps(sae.cfg.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(f"{weights_digest(sae)}|{config}".encode()).hexdigest()


class TopWindowsAndDensity:
    """The engine's reducer for SAE features: a running top-``k`` of each feature's per-window maxima (where in
    which window), so memory stays bounded by k x d_sae plus one batch, and a histogram of the log10 of its
    positive activations (``bin_edges()``).

    Example:
        >>> reducer = TopWindowsAndDensity(k=1, width=2)
        >>> reducer.add(0, torch.tensor([[[0.0, 10.0], [2.0, 0.0]], [[5.0, 0.0], [0.0, 0.0]]]), skip=1)
        >>> stored = reducer.tensors(); stored["top_values_WX"], stored["top_windows_WX"], stored["n_tokens"]
        (tensor([[ 5., 10.]]), tensor([[1, 0]]), tensor([4]))
    """

    def __init__(self, k: int, width: int):
        self.k, self.width = k, width
        self.key = {"statistic": "top-windows-and-density", "k": k, "bins": [*LOG10_RANGE, N_BINS]}
        self.values_WX = torch.empty(0, width)
        self.windows_WX = self.positions_WX = torch.empty(0, width, dtype=torch.long)
        self.counts_XZ = torch.zeros(width, N_BINS, dtype=torch.int64)
        self.n_tokens = 0

    def add(self, start: int, acts_BPX: Tensor, skip: int) -> None:
        X = self.width
        _histogram(acts_BPX.reshape(-1, X), self.counts_XZ)
        self.n_tokens += acts_BPX.shape[0] * acts_BPX.shape[1]
        max_BX, where_BX = (t.cpu() for t in acts_BPX.max(dim=1))
        # The running top-k: the kept rows and this batch's windows, the k best of them kept.
        values_NX = torch.cat([self.values_WX, max_BX])
        windows_NX = torch.cat([self.windows_WX, (start + torch.arange(len(max_BX)))[:, None].expand(-1, X)])
        positions_NX = torch.cat([self.positions_WX, where_BX + skip])
        self.values_WX, best_WX = values_NX.topk(min(self.k, len(values_NX)), dim=0)
        self.windows_WX, self.positions_WX = windows_NX.gather(0, best_WX), positions_NX.gather(0, best_WX)

    def tensors(self) -> dict[str, Tensor]:
        return {"top_values_WX": self.values_WX.contiguous(), "top_windows_WX": self.windows_WX.contiguous(),
                "top_positions_WX": self.positions_WX.contiguous(), "histogram_XZ": self.counts_XZ,
                "n_tokens": torch.tensor([self.n_tokens])}

    def check(self, stored: dict[str, Tensor], windows_BP: Tensor) -> bool:
        """Exactly its tensors, of their shapes and dtypes, values finite and descending, windows and positions
        inside the corpus, counts non-negative and at most the tokens read."""
        if set(stored) != TENSORS:
            return False
        B, P = windows_BP.shape
        shape_WX = (min(self.k, B), self.width)
        values, windows, positions = stored["top_values_WX"], stored["top_windows_WX"], stored["top_positions_WX"]
        histogram, n_tokens = stored["histogram_XZ"], stored["n_tokens"]
        if tuple(values.shape) != shape_WX or values.dtype != torch.float32 or not bool(values.isfinite().all()):
            return False
        if values.shape[0] > 1 and bool((values[1:] > values[:-1]).any()):
            return False
        for tensor, bound in ((windows, B), (positions, P)):
            if tuple(tensor.shape) != shape_WX or tensor.dtype != torch.int64:
                return False
            if tensor.numel() and not (int(tensor.min()) >= 0 and int(tensor.max()) < bound):
                return False
        if n_tokens.dtype != torch.int64 or n_tokens.numel() != 1 or int(n_tokens) < 0:
            return False
        if tuple(histogram.shape) != (self.width, N_BINS) or histogram.dtype != torch.int64:
            return False
        return not histogram.numel() or (int(histogram.min()) >= 0 and int(histogram.sum(1).max()) <= int(n_tokens))


def sae_source(model, sae: SAE) -> UnitSource:
    """The engine's unit source for ``sae``'s features: read with the SAE spliced in with its error term
    (``reading_features``), keyed by the SAE's weights and config.

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> source = sae_source(model, sae)
        >>> source.kind, source.label, source.width
        ('features', 'toy-attn-2l-blocks.0.hook_resid_post-4', 4)
    """

    @contextmanager
    def reading() -> Iterator:
        with reading_features(model, sae) as (name, stop):
            yield lambda tokens_BP: run_features(model, name, stop, tokens_BP)

    return UnitSource("features", f"{model.cfg.model_name or 'model'}-{sae.cfg.hook_name}-{sae.cfg.d_sae}",
                      {"sae": sae_digest(sae)}, sae.cfg.d_sae, reading)


def stats_path(model, sae: SAE, windows_BP: Tensor, k: int) -> Path:
    """The cache file of ``sae``'s statistics over ``windows_BP``: named by the model and hook, keyed by digests
    of the model's and the SAE's weights, the window ids, ``k``, the bins and the engine's format.

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> path = stats_path(model, sae, torch.zeros(2, 8, dtype=torch.long), k=5)
        >>> path.parent == cache_directory() / "features", path.suffix
        (True, '.safetensors')
    """
    return scan_path(model, sae_source(model, sae), TopWindowsAndDensity(k, sae.cfg.d_sae), windows_BP)


def _histogram(acts_NX: Tensor, counts_XZ: Tensor) -> None:
    """Adds each positive activation of ``acts_NX`` to its feature's log10 bin of ``counts_XZ`` (in place)."""
    tokens_n, features_n = (acts_NX > 0).nonzero(as_tuple=True)
    if not len(tokens_n):
        return
    log10_n = acts_NX[tokens_n, features_n].double().log10()
    # right=True: bin h holds edges[h] <= x < edges[h + 1] (numpy's convention); the inner edges only, so
    # values past either end land in the first or last bin.
    bins_n = torch.bucketize(log10_n, bin_edges()[1:-1].to(log10_n.device), right=True)
    counts_XZ.view(-1).index_add_(0, (features_n * N_BINS + bins_n).cpu(),
                                  torch.ones(len(bins_n), dtype=torch.int64))


def feature_corpus_stats(model, sae: SAE, n_windows: int = 256, window: int = 64, k: int = 10,
                         batch_size: int = 16, progress: ProgressArg = False, use_disk: bool = True,
                         corpus: Optional[str] = None) -> FeatureStats:
    """Every feature's ``k`` top windows (by the window's max activation, BOS left out) and its density
    histogram over ``n_windows`` windows of ``window`` tokens of ``corpus`` (``"english"``, ``"code"``, or None for
    the model's own; ``experiments.neurons.neuron_corpus``),
    read from the disk cache when there (no forward pass), else computed ``batch_size`` windows at a time
    (``progress`` counts the windows) and saved.

    Example:
        >>> _ = torch.manual_seed(0); sae = wb.SAE.from_tensors(wb.SAEConfig("topk", d_in=128, d_sae=16, k=3,
        ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.randn(128, 16),
        ...     "W_dec": torch.randn(16, 128), "b_enc": torch.zeros(16), "b_dec": torch.zeros(128)})
        >>> stats = feature_corpus_stats(model, sae, n_windows=8, window=16, k=4, use_disk=False)
        >>> stats.top_values_WX.shape, stats.histogram_XZ.shape, stats.n_tokens   # 8 windows of 15 tokens past BOS
        (torch.Size([4, 16]), torch.Size([16, 40]), 120)
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"k and batch_size must be at least 1, got k={k}, batch_size={batch_size}")
    check_feature(sae, 0)  # an SAE at all
    reducer = TopWindowsAndDensity(k, sae.cfg.d_sae)
    scan = scan_corpus(model, sae_source(model, sae), reducer, n_windows, window, batch_size, progress, use_disk,
                       corpus)
    stored = scan.tensors
    return FeatureStats(scan.windows_BP, stored["top_values_WX"], stored["top_windows_WX"],
                        stored["top_positions_WX"], stored["histogram_XZ"], int(stored["n_tokens"]), scan.path,
                        scan.from_disk)


def feature_top_windows(model, stats: FeatureStats, feature: int, k: int = 10) -> pd.DataFrame:
    """The ``k`` windows where ``feature`` peaks highest, windows where it never fired left out:
    DataFrame[rank, window, position, token, max_activation, text] (the Neurons page's table, so
    ``experiments.plots.neurons.top_windows_html`` draws it).

    Example:
        >>> stats = FeatureStats(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[2.0], [0.0]]),
        ...                      torch.tensor([[1], [0]]), torch.tensor([[2], [1]]), torch.zeros(1, 40, dtype=torch.long),
        ...                      4, None, False)   # 2 windows of 3 tokens, 1 feature that fired in window 1 only
        >>> feature_top_windows(model, stats, 0)[["rank", "window", "position", "max_activation"]].values.tolist()
        [[1.0, 1.0, 2.0, 2.0]]
    """
    if not 0 <= feature < stats.top_values_WX.shape[1]:
        raise InputError(f"feature {feature!r} is out of range: this SAE has features "
                         f"0..{stats.top_values_WX.shape[1] - 1}")
    rows = []
    for rank in range(min(k, stats.top_values_WX.shape[0])):
        value = float(stats.top_values_WX[rank, feature])
        if value <= 0:
            break
        w, position = int(stats.top_windows_WX[rank, feature]), int(stats.top_positions_WX[rank, feature])
        window_tokens = str_tokens(model, stats.windows_BP[w])
        rows.append({"rank": rank + 1, "window": w, "position": position, "token": window_tokens[position],
                     "max_activation": value, "text": "".join(window_tokens)})
    return pd.DataFrame(rows, columns=["rank", "window", "position", "token", "max_activation", "text"])


def feature_density(stats: FeatureStats, feature: int) -> pd.DataFrame:
    """``feature``'s activation-density histogram: DataFrame[log10_low, log10_high, count, fraction] (fraction of
    all tokens read; their sum is the feature's firing density).

    Example:
        >>> counts = torch.zeros(1, 40, dtype=torch.long); counts[0, 25] = 3
        >>> stats = FeatureStats(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long),
        ...                      torch.zeros(1, 1, dtype=torch.long), counts, 12, None, False)
        >>> density = feature_density(stats, 0); density.loc[25].tolist(), float(density.fraction.sum())
        ([0.0, 0.2, 3.0, 0.25], 0.25)
    """
    if not 0 <= feature < stats.histogram_XZ.shape[0]:
        raise InputError(f"feature {feature!r} is out of range: this SAE has features "
                         f"0..{stats.histogram_XZ.shape[0] - 1}")
    edges = bin_edges().numpy()
    counts = stats.histogram_XZ[feature].numpy()
    return pd.DataFrame({"log10_low": edges[:-1].round(6) + 0.0, "log10_high": edges[1:].round(6) + 0.0, "count": counts,
                         "fraction": counts / max(stats.n_tokens, 1)})
