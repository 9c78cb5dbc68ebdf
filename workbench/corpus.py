"""The training corpus: the Python standard library's own source files on this machine.

Every machine that runs the workbench has a Python standard library, so the zoo models can be
retrained without a network. The files are chosen by a fixed rule and taken in sorted order:

- every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, by POSIX path relative to that root;
- except anything under a directory named ``test``, ``tests``, ``idle_test``, ``site-packages``
  or ``__pycache__`` (test suites are full of generated data, site-packages is not the stdlib);
- except ``encodings/`` (codec tables, not code), ``config-*/`` and ``_sysconfigdata_*.py``
  (generated at build time, so they differ from machine to machine).

Held out: every ``HELD_OUT_EVERY``-th file of that sorted list (indices 19, 39, ...), i.e. 5% of
the files spread over the whole library rather than one alphabetical corner of it.

Example:
    >>> corpus = stdlib_corpus()   # about 600 files (580 train, 30 held out on Python 3.11)
    >>> len(corpus.held_out) == (len(corpus.train) + len(corpus.held_out)) // HELD_OUT_EVERY
    True
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from workbench.errors import InputError

EXCLUDED_DIRECTORIES = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings"})
HELD_OUT_EVERY = 20  # 1 file in 20 (5%) is held out


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: its path relative to the stdlib root, and its text.

    Example:
        >>> stdlib_corpus(stdlib_root() / "json").train[0].relative_path
        '__init__.py'
    """

    relative_path: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The train and held-out files, and enough provenance to say exactly what was read.

    Example:
        >>> corpus = stdlib_corpus(stdlib_root() / "json")   # one package of the stdlib: few files, none held out
        >>> corpus.python_version == platform.python_version(), len(corpus.held_out)
        (True, 0)
    """

    root: str
    python_version: str
    train: tuple[SourceFile, ...]
    held_out: tuple[SourceFile, ...]

    @property
    def sha256(self) -> str:
        """One digest over every path and text (train then held-out), to compare corpora across machines.

        Example:
            >>> root = stdlib_root() / "json"
            >>> stdlib_corpus(root).sha256 == stdlib_corpus(root).sha256 != stdlib_corpus(root, max_files=2).sha256
            True
        """
        digest = hashlib.sha256()
        for source in self.train + self.held_out:
            digest.update(source.relative_path.encode() + b"\0" + source.text.encode() + b"\0")
        return digest.hexdigest()

    def manifest(self) -> str:
        """A text listing of every file and its split, for the model card's directory.

        Example:
            >>> print(stdlib_corpus(stdlib_root() / "json", max_files=2).manifest())
            # Python ... standard library at .../json
            # corpus sha256 ...
            # split  bytes  path
            train    ...    __init__.py
            train    ...    decoder.py
        """
        lines = [f"# Python {self.python_version} standard library at {self.root}",
                 f"# corpus sha256 {self.sha256}", "# split\tbytes\tpath"]
        lines += [f"train\t{len(s.text.encode())}\t{s.relative_path}" for s in self.train]
        lines += [f"held_out\t{len(s.text.encode())}\t{s.relative_path}" for s in self.held_out]
        return "\n".join(lines) + "\n"


def stdlib_root() -> Path:
    """The directory of this interpreter's pure-Python standard library.

    Example:
        >>> (stdlib_root() / "argparse.py").is_file()
        True
    """
    return Path(sysconfig.get_paths()["stdlib"])


def is_corpus_file(relative: Path) -> bool:
    """Whether a ``*.py`` path (relative to the stdlib root) belongs in the corpus.

    Example:
        >>> is_corpus_file(Path("json/decoder.py")), is_corpus_file(Path("unittest/test/test_case.py"))
        (True, False)
    """
    parts = relative.parts
    if any(part in EXCLUDED_DIRECTORIES for part in parts[:-1]):
        return False
    if parts[0].startswith("config-") or relative.name.startswith("_sysconfigdata_"):
        return False
    return relative.suffix == ".py"


def stdlib_source_paths(root: Optional[Union[str, Path]] = None) -> list[str]:
    """Sorted POSIX paths (relative to ``root``) of every corpus file.

    Example:
        >>> paths = stdlib_source_paths(stdlib_root() / "unittest")   # one package, paths relative to it
        >>> "case.py" in paths, any(path.startswith("test/") for path in paths)
        (True, False)
    """
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise InputError(f"standard library directory {root} does not exist")
    found = [p.relative_to(root) for p in root.rglob("*.py") if p.is_file()]
    return sorted(p.as_posix() for p in found if is_corpus_file(p))


def stdlib_corpus(root: Optional[Union[str, Path]] = None, max_files: Optional[int] = None) -> Corpus:
    """Reads the corpus files and splits them into train / held-out (every 20th file held out).

    ``max_files`` keeps only the first files of the sorted list (for quick tests). Files that
    are not valid UTF-8 are read with replacement characters so the result never depends on
    the locale.

    Example:
        >>> corpus = stdlib_corpus(stdlib_root() / "email", max_files=20)   # the 20th file is held out
        >>> len(corpus.train), len(corpus.held_out)
        (19, 1)
    """
    root = Path(root) if root is not None else stdlib_root()
    paths = stdlib_source_paths(root)[:max_files]
    if not paths:
        raise InputError(f"no corpus files found under {root}")
    train, held_out = [], []
    for index, relative in enumerate(paths):
        text = (root / relative).read_bytes().decode("utf-8", errors="replace")
        split = held_out if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train
        split.append(SourceFile(relative, text))
    return Corpus(root=str(root), python_version=platform.python_version(), train=tuple(train),
                  held_out=tuple(held_out))
