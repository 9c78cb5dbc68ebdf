"""A neuron's top-activating windows over the bundled corpus, computed once per MLP for all its neurons and
cached on disk (the package docstring, ``experiments.neurons``, says how)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import pandas as pd
import torch
from jaxtyping import Float, Int
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments._tokens import str_tokens
from experiments.datasets import corpus_windows
from experiments.neurons.units import MLPUnit, unit_activations
from workbench.corpus import stdlib_root, stdlib_source_paths
from workbench.errors import InputError

CACHE_ENV = "WORKBENCH_CACHE_DIR"
FORMAT = "workbench-neuron-maxima-1"
DOC_CHARS = 2000  # each corpus file contributes its first ~2000 characters, so windows span many modules
CHARS_PER_TOKEN = 4  # a generous guess for code; too few windows and the corpus is doubled



def cache_directory() -> Path:
    """Where the workbench caches results on disk: ``$WORKBENCH_CACHE_DIR``, else ``~/.cache/workbench``.

    Example:
        >>> cache_directory().name in ("workbench",) or bool(os.environ.get("WORKBENCH_CACHE_DIR"))
        True
    """
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "workbench").expanduser()


_DIGESTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def weights_digest(model) -> str:
    """SHA-256 of every tensor of the model's state (names, shapes, dtypes, bytes).

    Remembered per model until a parameter is changed in place or replaced (its version counter or
    storage moves), so a page pays for it once (~0.5 s for SmolLM2's 135M parameters).

    Example:
        >>> len(weights_digest(model)), weights_digest(model) == weights_digest(model)
        (64, True)
    """
    state = model.state_dict()
    stamp = tuple((t.data_ptr(), t._version) for t in state.values())
    remembered = _DIGESTS.get(model)
    if remembered is not None and remembered[0] == stamp:
        return remembered[1]
    digest = hashlib.sha256()
    for name, tensor in state.items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")
    _DIGESTS[model] = (stamp, digest.hexdigest())
    return digest.hexdigest()


@lru_cache(maxsize=1)
def _corpus_paths() -> tuple[Path, ...]:
    root = stdlib_root()
    return tuple(root / relative for relative in stdlib_source_paths(root))


def _corpus_texts(n_chars: int) -> list[str]:
    """The first ~DOC_CHARS characters (whole lines) of evenly spaced corpus files, ``n_chars`` in all."""
    paths = _corpus_paths()
    n_docs = min(len(paths), max(1, math.ceil(n_chars / DOC_CHARS)))
    texts = []
    for i in range(n_docs):
        text = paths[i * len(paths) // n_docs].read_bytes().decode("utf-8", errors="replace")
        head = text[:DOC_CHARS].rsplit("\n", 1)[0] if len(text) > DOC_CHARS else text
        if head.strip():
            texts.append(head)
    return texts


def neuron_corpus(model, n_windows: int = 256, window: int = 64) -> Int[Tensor, "batch pos"]:
    """The ``n_windows`` corpus windows of ``window`` tokens the top-window search reads (fewer only
    when the whole corpus is shorter).

    Example:
        >>> neuron_corpus(model, n_windows=16, window=64).shape
        torch.Size([16, 64])
    """
    if n_windows < 1:
        raise InputError(f"n_windows must be at least 1, got {n_windows}")
    n_chars = n_windows * window * CHARS_PER_TOKEN
    while True:
        texts = _corpus_texts(n_chars)
        windows_BP = corpus_windows(model, texts, window=window, max_windows=n_windows)
        if windows_BP.shape[0] >= n_windows or len(texts) >= len(_corpus_paths()):
            return windows_BP
        n_chars *= 2


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


def maxima_path(model, unit: MLPUnit, windows_BP: Tensor) -> Path:
    """The cache file of ``unit``'s maxima over ``windows_BP``: named by the model and MLP, keyed by a
    digest of the weights, the MLP, the window ids and the format.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)
        >>> path = maxima_path(moe_model, MLPUnit(1, expert=3), neuron_corpus(moe_model, n_windows=16))
        >>> path.parent == cache_directory() / "neurons", path.suffix
        (True, '.safetensors')
    """
    key = json.dumps({"format": FORMAT, "weights": weights_digest(model), "unit": [unit.layer, unit.expert, unit.shared],
                      "windows": hashlib.sha256(windows_BP.cpu().long().numpy().tobytes()).hexdigest(),
                      "shape": list(windows_BP.shape)})
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{model.cfg.model_name or 'model'}-{unit.label}")
    return cache_directory() / "neurons" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"


def _read_maxima(path: Path, windows_BP: Tensor, width: int) -> Optional[CorpusMaxima]:
    """The cached maxima, or None when the file is missing, unreadable, for other windows, or not what
    ``corpus_maxima`` writes (then it is recomputed and replaced): exactly its three tensors, the maxima
    floating-point [B, width] without NaN, the positions integers [B, width] inside the window (a -1
    would silently index the window's last token).

    Example:
        >>> _read_maxima(Path("no/such/maxima.safetensors"), torch.zeros(2, 8, dtype=torch.long), 16) is None
        True
    """
    try:
        stored = load_file(str(path))
    except (OSError, SafetensorError, ValueError):
        return None
    windows_BP = windows_BP.cpu().long()
    if set(stored) != {"windows_BP", "max_BM", "argmax_BM"} or not torch.equal(stored["windows_BP"], windows_BP):
        return None
    max_BM, argmax_BM = stored["max_BM"], stored["argmax_BM"]
    shape = (windows_BP.shape[0], width)
    if tuple(max_BM.shape) != shape or not max_BM.is_floating_point() or bool(max_BM.isnan().any()):
        return None
    if tuple(argmax_BM.shape) != shape or argmax_BM.dtype not in (torch.int32, torch.int64):
        return None
    if argmax_BM.numel() and not (0 <= int(argmax_BM.min()) and int(argmax_BM.max()) < windows_BP.shape[1]):
        return None
    return CorpusMaxima(windows_BP, max_BM, argmax_BM.long(), path, True)


def _write_atomically(path: Path, tensors: dict[str, Tensor]) -> None:
    """Writes to a temporary file and renames it: an interrupted write leaves no file under ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(temporary))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


@torch.no_grad()
def corpus_maxima(model, unit: MLPUnit, n_windows: int = 256, window: int = 64, batch_size: int = 16,
                  progress: ProgressArg = False, use_disk: bool = True) -> CorpusMaxima:
    """Every neuron of ``unit``: its max activation in each corpus window and the position of that max,
    read from the disk cache when there (no forward pass), else computed ``batch_size`` windows at a
    time (``progress`` counts the windows) and saved.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> maxima = corpus_maxima(moe_model, MLPUnit(1, expert=3), n_windows=16, window=32, use_disk=False)
        >>> maxima.max_BM.shape, maxima.from_disk
        (torch.Size([16, 256]), False)
    """
    width = unit.width(model.cfg)
    windows_BP = neuron_corpus(model, n_windows, window).cpu().long()
    path = maxima_path(model, unit, windows_BP) if use_disk else None
    cached = _read_maxima(path, windows_BP, width) if path is not None and path.is_file() else None
    if cached is not None:
        return cached
    skip = 1 if model.bos_first() else 0  # BOS's activations are outliers, not evidence
    maxima, argmaxima = [], []
    with Progress(progress, total=windows_BP.shape[0], desc=f"{unit.label} over the corpus") as bar:
        for start in range(0, windows_BP.shape[0], batch_size):
            chunk_BP = windows_BP[start:start + batch_size].to(model.cfg.device)
            acts_BPM, _ = unit_activations(model, chunk_BP, unit)
            values_BM, where_BM = acts_BPM[:, skip:].nan_to_num(nan=-math.inf).max(dim=1)
            maxima.append(values_BM.cpu())
            argmaxima.append((where_BM + skip).cpu())
            bar.advance(chunk_BP.shape[0])
    result = CorpusMaxima(windows_BP, torch.cat(maxima), torch.cat(argmaxima), path, False)
    if path is None:
        return result
    try:
        _write_atomically(path, {"windows_BP": windows_BP, "max_BM": result.max_BM, "argmax_BM": result.argmax_BM.int()})
    except OSError:  # a read-only or full cache directory: the result stands, it is just not kept
        return dataclasses.replace(result, path=None)
    return result


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
