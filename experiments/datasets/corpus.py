"""Fixed-length windows of token ids cut from a corpus (text files, a directory, or a list of texts).

Legend: P position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from jaxtyping import Int
from torch import Tensor

from workbench.errors import InputError


def corpus_windows(model, source: Union[str, Path, Sequence[str]], window: int = 128, stride: Optional[int] = None,
                   max_windows: Optional[int] = None, pattern: str = "*.txt") -> Int[Tensor, "n_windows window"]:
    """Fixed-length windows of token ids cut from a corpus.

    ``source``: a text file, a directory (every file matching ``pattern`` below it, recursively,
    in sorted path order, read as UTF-8), or a list of texts (a lone string is a path, never text).

    The rule: each document is tokenized without BOS; documents are joined into one stream with
    the EOS token between them (when the tokenizer has one). When the model prepends BOS
    (``model.bos_first()``), every window is BOS followed by ``window - 1`` stream tokens;
    otherwise ``window`` stream tokens. Windows start every ``stride`` stream tokens (default:
    the window's stream length, so windows neither overlap nor skip); a tail shorter than a
    window is dropped; ``max_windows`` keeps the first ones.

    Raises ``InputError`` for a missing path, a directory with no file matching ``pattern``, an
    empty text, a corpus shorter than one window, a window longer than the model's context,
    and non-positive window, stride or max_windows.

    Example:
        >>> windows = corpus_windows(model, ["The cat sat on the mat. " * 20, "A dog ran in the park. " * 10], window=16)
        >>> windows.shape                                # BOS then 15 text tokens in each window
        torch.Size([20, 16])
        >>> model.to_string(windows[0])
        '<|endoftext|>The cat sat on the mat. The cat sat'
    """
    if model.tokenizer is None:
        raise InputError("corpus_windows needs a model with a tokenizer: the corpus is text")
    bos = model.bos_first()
    stream_len = window - 1 if bos else window  # stream tokens per window
    _check_window(model, window, stream_len, bos)
    stride = stream_len if stride is None else stride
    if stride < 1:
        raise InputError(f"stride must be at least 1, got {stride}")
    if max_windows is not None and max_windows < 1:
        raise InputError(f"max_windows must be at least 1 (or None for all), got {max_windows}")

    stream = _token_stream(model, _documents(source, pattern))
    if stream.numel() < stream_len:
        raise InputError(f"the corpus has {stream.numel()} tokens, fewer than one window of {window} "
                         f"({stream_len} text tokens{' after BOS' if bos else ''})")
    windows = stream.unfold(0, stream_len, stride)[:max_windows]
    if bos:
        first = torch.full((windows.shape[0], 1), model.tokenizer.bos_token_id, dtype=windows.dtype)
        windows = torch.cat([first, windows], dim=1)
    return windows.contiguous().to(model.cfg.device)


def _check_window(model, window: int, stream_len: int, bos: bool) -> None:
    """A window holds at least one text token and fits the model's context (when it has a limit)."""
    if stream_len < 1:
        raise InputError(f"window must hold at least one text token: got window={window}"
                         f"{' (one position is BOS)' if bos else ''}")
    limit = model.cfg.context_limit
    if limit is not None and window > limit:
        raise InputError(f"window={window} is longer than the model's context (n_ctx={limit})")


def _documents(source: Union[str, Path, Sequence[str]], pattern: str) -> list[tuple[str, str]]:
    """(name, text) of each document: a file, the files of a directory, or a list of texts."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(p for p in path.rglob(pattern) if p.is_file())
            if not files:
                raise InputError(f"no file matching {pattern!r} under the directory {path}")
        else:
            raise InputError(f"no such file or directory: {path} (to pass text itself, give a list of texts)")
        documents = [(str(p), _read_utf8(p)) for p in files]
    else:
        documents = [(f"text {i}", text) for i, text in enumerate(source)]
        if not documents:
            raise InputError("the list of texts is empty")
    for name, text in documents:
        if not isinstance(text, str):
            raise InputError(f"{name} is a {type(text).__name__}, not a string")
        if not text.strip():
            raise InputError(f"{name} is empty (no text to tokenize)")
    return documents


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{path} is not UTF-8 text: {error}") from None


def _token_stream(model, documents: list[tuple[str, str]]) -> Int[Tensor, "stream"]:
    """The documents' tokens (no BOS) on the CPU, joined with EOS when the tokenizer has one."""
    eos = model.tokenizer.eos_token_id
    pieces = []
    for index, (_, text) in enumerate(documents):
        if index and eos is not None:
            pieces.append(torch.tensor([eos], dtype=torch.long))
        pieces.append(model.to_tokens(text, prepend_bos=False)[0].cpu())
    return torch.cat(pieces)

