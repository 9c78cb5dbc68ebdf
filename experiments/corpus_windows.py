"""One engine for "which corpus windows does each unit fire on most": a set of units (an MLP's neurons, an SAE's
features) scanned over windows of the bundled corpus in batches, its statistics kept in one disk cache.

Shapes: windows_BP [B batch (windows), P position]; a source's activations are [batch, pos, units], units being
an MLP's neurons (M d_mlp) or an SAE's features (X d_sae), so the engine names them ``acts`` alone.

The corpus (``bundled_windows``): ``window``-token windows of one of two corpora (``CORPORA``), the first ~2,000
characters of evenly spaced documents so that windows span many of them, cut by
``experiments.datasets.corpus_windows``: ``"code"``, the Python standard library's files (``workbench.corpus``, the
text the zoo's toys train on), or ``"english"``, the English prose of ``english_documents("train")`` (Debian's
fortunes and debian-handbook: ``make setup-corpus``). By default a model reads the corpus it was trained on
(``default_corpus``: its registry entry's ``corpus``, ``wb.list_models()``; English for a model not registered). What is scanned (``UnitSource``): a block of code that yields a
function from a batch of windows to the units' activations [batch, pos, units] (NaN where a unit did not run, as a routed
expert off its tokens). What is kept (a ``Reducer``): the statistics one pass accumulates, batch by batch (each
window's maxima for neurons; a running top-k and a density histogram for features). BOS is left out (its
activations are outliers, not evidence).

The cache: one safetensors file per scan under ``cache_directory()/<source kind>/``, named by the source's label
and a digest of its key. The key is the engine's version, the model's identity (a digest of its weights), the
unit source's identity (the MLP, or the SAE's weights and config), the corpus's identity (the window ids) and
the reducer's parameters; it is stored in the file's metadata and checked before any tensor is read, and the
tensors are then checked by the reducer (shapes, dtypes, ranges) before use, so a stale, foreign or tampered
file is recomputed and replaced. Files are written through ``workbench.safe_files.save_files`` (a temporary name
renamed into place: an interrupted write leaves no file); a read-only or full cache directory keeps the result
in memory only.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch
from jaxtyping import Float, Int
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.datasets import corpus_windows
from experiments.datasets import english
from workbench.corpus import stdlib_root, stdlib_source_paths
from workbench.loading.registry import CORPORA, model_corpus
from workbench.cache_dir import CACHE_ENV, cache_directory  # re-exported here, where callers have imported them
from workbench.errors import CheckpointError, InputError
from workbench.safe_files import inside, save_files

ENGINE = "workbench-corpus-windows-2"  # the cache's format: a new one never reads another's files
DOC_CHARS = 2000  # each corpus file contributes its first ~2000 characters, so windows span many modules
CHARS_PER_TOKEN = 4  # a generous guess for code; too few windows and the corpus is doubled
MAX_KEY_CHARS = 1 << 16  # a stored key longer than this is not one we wrote
CORPUS_LABELS = {"english": "English", "code": "Python source"}  # the pages' "Corpus" select box
CORPUS_SOURCES = {"english": "English documents (Debian's fortunes and The Debian Administrator's Handbook)",
                  "code": "files of the Python standard library (the zoo's training corpus)"}  # the pages' captions


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
def _code_paths() -> tuple[Path, ...]:
    root = stdlib_root()
    return tuple(root / relative for relative in stdlib_source_paths(root))


@lru_cache(maxsize=2)
def _english_train(fortunes: Path, handbook: Path) -> tuple[str, ...]:
    """``english_documents("train")``, read once per pair of package folders (keyed by them, so a moved or
    missing folder is read afresh and raises ``english``'s ``InputError`` naming ``make setup-corpus``)."""
    return tuple(english.english_documents("train"))


def _documents(corpus: str) -> tuple[int, Callable[[int], str]]:
    """How many documents ``corpus`` has and how to read the i-th."""
    if corpus == "code":
        paths = _code_paths()
        return len(paths), lambda i: paths[i].read_bytes().decode("utf-8", errors="replace")
    documents = _english_train(english.FORTUNES, english.HANDBOOK)
    return len(documents), documents.__getitem__


def _corpus_texts(corpus: str, n_chars: int) -> tuple[list[str], bool]:
    """The first ~DOC_CHARS characters (whole lines) of evenly spaced documents of ``corpus``, ``n_chars`` in all,
    and whether every document was read."""
    n_total, read = _documents(corpus)
    n_docs = min(n_total, max(1, math.ceil(n_chars / DOC_CHARS)))
    texts = []
    for i in range(n_docs):
        text = read(i * n_total // n_docs)
        head = text[:DOC_CHARS].rsplit("\n", 1)[0] if len(text) > DOC_CHARS else text
        if head.strip():
            texts.append(head)
    return texts, n_docs >= n_total


def default_corpus(model) -> str:
    """The corpus ``model`` reads by default: the one it was trained on, from its registry entry
    (``workbench.loading.registry.model_corpus`` by ``model.cfg.model_name``): ``"code"`` for the zoo's toys,
    ``"english"`` for every other model.

    Example:
        >>> default_corpus(model)   # the zoo's toy-attn-2l, trained on Python source
        'code'
    """
    return model_corpus(getattr(model.cfg, "model_name", None))


def resolve_corpus(model, corpus: Optional[str] = None) -> str:
    """``corpus`` checked (one of ``CORPORA``), or the model's own (``default_corpus``) when None.

    Example:
        >>> resolve_corpus(model), resolve_corpus(model, "english")
        ('code', 'english')
    """
    if corpus is None:
        return default_corpus(model)
    if corpus not in CORPORA:
        raise InputError(f"corpus must be one of {CORPORA} (or None for the model's own), got {corpus!r}")
    return corpus


def bundled_windows(model, n_windows: int = 256, window: int = 64,
                    corpus: Optional[str] = None) -> Int[Tensor, "batch pos"]:
    """The ``n_windows`` windows of ``window`` tokens of ``corpus`` (``"english"`` or ``"code"``; None: the
    model's own, ``default_corpus``) every scan reads (fewer only when the whole corpus is shorter);
    ``experiments.neurons.neuron_corpus``. English needs ``make setup-corpus`` (else an ``InputError`` saying so).

    Example:
        >>> bundled_windows(model, n_windows=16, window=64).shape
        torch.Size([16, 64])
    """
    if isinstance(n_windows, bool) or not isinstance(n_windows, int) or n_windows < 1:
        raise InputError(f"n_windows must be at least 1, got {n_windows!r}")
    corpus = resolve_corpus(model, corpus)
    n_chars = n_windows * window * CHARS_PER_TOKEN
    while True:
        texts, read_all = _corpus_texts(corpus, n_chars)
        try:
            windows_BP = corpus_windows(model, texts, window=window, max_windows=n_windows)
        except InputError:  # fewer tokens than one window (a few short fortunes): read more documents
            if read_all:  # else the error is about the model or the window, raised before any tokenizing
                raise
            n_chars *= 2
            continue
        if windows_BP.shape[0] >= n_windows or read_all:
            return windows_BP
        n_chars *= 2


@dataclass(frozen=True)
class UnitSource:
    """What a scan reads: ``reading()`` is a block of code yielding ``activations(tokens_BP) -> acts`` (float,
    NaN where a unit did not run); ``identity`` is everything besides the model's weights that decides those
    activations (it joins the cache key); ``kind`` names the cache's sub-folder and ``label`` its file.

    Example:
        >>> from contextlib import nullcontext
        >>> source = UnitSource("demo", "toy-embeddings", {"hook": "hook_embed"}, 128,
        ...                     lambda: nullcontext(lambda tokens_BP: model.embed(tokens_BP)))
        >>> source.width
        128
    """

    kind: str
    label: str
    identity: dict
    width: int
    reading: Callable[[], AbstractContextManager[Callable[[Tensor], Tensor]]] = field(compare=False, repr=False)


class Reducer(Protocol):
    """The statistics one scan accumulates: ``key`` (its parameters, for the cache key), ``add`` (one batch's
    activations past BOS, ``skip`` positions dropped at the front, its first window's index ``start``),
    ``tensors`` (what is kept) and ``check`` (whether tensors read back are exactly what ``tensors`` writes)."""

    key: dict

    def add(self, start: int, acts: Tensor, skip: int) -> None: ...

    def tensors(self) -> dict[str, Tensor]: ...

    def check(self, stored: dict[str, Tensor], windows_BP: Tensor) -> bool: ...


@dataclass(frozen=True)
class CorpusScan:
    """One scan's windows and statistics; ``path`` is its cache file (None when not kept), ``from_disk`` whether
    it was read from there (no forward pass)."""

    windows_BP: Int[Tensor, "batch pos"]
    tensors: dict = field(repr=False)
    path: Optional[Path]
    from_disk: bool


def cache_key(model, source: UnitSource, reducer: Reducer, windows_BP: Tensor) -> str:
    """The scan's cache key (JSON): engine version, model digest, unit source, corpus window ids, reducer.

    Example:
        >>> from contextlib import nullcontext
        >>> source = UnitSource("demo", "demo", {"hook": "hook_embed"}, 128, nullcontext)
        >>> reducer = type("Reducer", (), {"key": {"statistic": "demo"}})()
        >>> sorted(json.loads(cache_key(model, source, reducer, torch.zeros(2, 8, dtype=torch.long))))
        ['corpus', 'engine', 'model', 'reducer', 'source']
    """
    windows = windows_BP.cpu().long()
    corpus = {"shape": list(windows.shape), "windows": hashlib.sha256(windows.numpy().tobytes()).hexdigest()}
    return json.dumps({"engine": ENGINE, "model": weights_digest(model), "source": source.identity,
                       "corpus": corpus, "reducer": reducer.key}, sort_keys=True, default=str)


def scan_path(model, source: UnitSource, reducer: Reducer, windows_BP: Tensor) -> Path:
    """The cache file of this scan: ``cache_directory()/<source kind>/<label>-<key digest>.safetensors``.

    Example:
        >>> from contextlib import nullcontext
        >>> source = UnitSource("demo", "toy embeddings", {"hook": "hook_embed"}, 128, nullcontext)
        >>> reducer = type("Reducer", (), {"key": {"statistic": "demo"}})()
        >>> path = scan_path(model, source, reducer, torch.zeros(2, 8, dtype=torch.long))
        >>> path.parent == cache_directory() / "demo", path.name.startswith("toy_embeddings-"), path.suffix
        (True, True, '.safetensors')
    """
    key = cache_key(model, source, reducer, windows_BP)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", source.label)
    return cache_directory() / source.kind / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"


def read_scan(path: Path, key: str, windows_BP: Tensor, reducer: Reducer) -> Optional[dict[str, Tensor]]:
    """The cached statistics, or None when the file is missing, unreadable, a link out of its folder, under
    another key (checked before any tensor is read), for other windows, or not what ``reducer`` writes.

    Example:
        >>> read_scan(Path("no/such/scan.safetensors"), "{}", torch.zeros(2, 8, dtype=torch.long), None) is None
        True
    """
    try:
        with safe_open(str(inside(path.parent, path.name, must_exist=True, what="cache")), framework="pt") as file:
            stored_key = (file.metadata() or {}).get("key")
            if stored_key is None or len(stored_key) > MAX_KEY_CHARS or stored_key != key:
                return None
            stored = {name: file.get_tensor(name) for name in file.keys()}
    except (OSError, SafetensorError, ValueError, RuntimeError):  # CheckpointError is a ValueError
        return None
    windows = stored.pop("windows_BP", None)
    if windows is None or not torch.equal(windows, windows_BP.cpu().long()) or not reducer.check(stored, windows):
        return None
    return stored


def _save(path: Path, key: str, windows_BP: Tensor, tensors: dict[str, Tensor]) -> None:
    every = {"windows_BP": windows_BP, **{name: t.contiguous() for name, t in tensors.items()}}
    save_files(path.parent, {path.name: lambda temporary: save_file(every, str(temporary), metadata={"key": key})},
               what="cache")


@torch.no_grad()
def scan_corpus(model, source: UnitSource, reducer: Reducer, n_windows: int = 256, window: int = 64,
                batch_size: int = 16, progress: ProgressArg = False, use_disk: bool = True,
                corpus: Optional[str] = None) -> CorpusScan:
    """``reducer``'s statistics of ``source``'s units over ``n_windows`` windows of ``window`` tokens of ``corpus``
    (``bundled_windows``: ``"english"``, ``"code"``, or None for the model's own), read
    from the disk cache when there (no forward pass), else computed ``batch_size`` windows at a time
    (``progress`` counts the windows) and saved.

    Example (the model's embeddings as 128 "units", each window's maximum kept):
        >>> from contextlib import nullcontext
        >>> class Maxima:
        ...     key = {"statistic": "max"}
        ...     def __init__(self): self.rows = []
        ...     def add(self, start, acts, skip): self.rows.append(acts.max(dim=1).values)
        ...     def tensors(self): return {"max_per_window": torch.cat(self.rows)}
        ...     def check(self, stored, windows_BP): return set(stored) == {"max_per_window"}
        >>> source = UnitSource("demo", "embeddings", {"hook": "hook_embed"}, 128,
        ...                     lambda: nullcontext(lambda tokens_BP: model.embed(tokens_BP)))
        >>> scan = scan_corpus(model, source, Maxima(), n_windows=4, window=16, use_disk=False)
        >>> scan.tensors["max_per_window"].shape, scan.from_disk
        (torch.Size([4, 128]), False)
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be at least 1, got {batch_size!r}")
    windows_BP = bundled_windows(model, n_windows, window, corpus).cpu().long()
    path = key = None
    if use_disk:
        key = cache_key(model, source, reducer, windows_BP)
        path = scan_path(model, source, reducer, windows_BP)
        cached = read_scan(path, key, windows_BP, reducer)
        if cached is not None:
            return CorpusScan(windows_BP, cached, path, True)
    skip = 1 if model.bos_first() else 0  # BOS's activations are outliers, not evidence
    with source.reading() as activations, \
            Progress(progress, total=windows_BP.shape[0], desc=f"{source.label} over the corpus") as bar:
        for start in range(0, windows_BP.shape[0], batch_size):
            chunk_BP = windows_BP[start:start + batch_size]
            reducer.add(start, activations(chunk_BP.to(model.cfg.device))[:, skip:], skip)
            bar.advance(chunk_BP.shape[0])
    tensors = reducer.tensors()
    if path is None:
        return CorpusScan(windows_BP, tensors, None, False)
    try:
        _save(path, key, windows_BP, tensors)
    except (OSError, CheckpointError):  # a read-only, full or linked cache directory: the result is just not kept
        return CorpusScan(windows_BP, tensors, None, False)
    return CorpusScan(windows_BP, tensors, path, False)
