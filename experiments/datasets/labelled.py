"""Labelled texts for probing, from text that exists offline: which language, code or prose, which handbook chapter.

Three tasks, each a list of texts with one integer label per text (``LabelledTexts``), bounded to ``per_class``
texts per class, chosen deterministically (every class's documents in a fixed order, evenly spaced):

- ``"language"``: Debian's fortune cookies in English (``fortunes``), German (``fortunes-de``, in ``de/``) and
  Spanish (``fortunes-es``, in ``es/``); a class whose package is not installed is left out (two are needed).
  ``fortunes-it`` is not used: it links its Italian files into the English directory itself, which would mix
  Italian into every English reader (``english_documents`` too).
- ``"code_vs_prose"``: chunks of the Python standard library's source (``workbench.corpus``) against English
  prose (``english_documents``).
- ``"handbook_chapter"``: paragraphs of the ``n_chapters`` longest chapters of *The Debian Administrator's
  Handbook*, one class per chapter.

Texts shorter than ``MIN_CHARS`` are dropped and longer ones cut to ``MAX_CHARS`` (SAEBench truncates to its
context length anyway). ``make setup-corpus`` installs every package.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import InputError

FORTUNES = Path("/usr/share/games/fortunes")
HANDBOOK = Path("/usr/share/doc/debian-handbook/html/en-US")
INSTALL = "apt-get install fortunes fortunes-de fortunes-es debian-handbook (or `make setup-corpus`)"
TASKS = ("language", "code_vs_prose", "handbook_chapter")
MIN_CHARS, MAX_CHARS = 40, 600
LANGUAGE_DIRECTORIES = {"en": FORTUNES, "de": FORTUNES / "de", "es": FORTUNES / "es"}
_SKIPPED = ("art", "ascii-art", "asciiart", "translate-me", "translations")  # pictures in characters; mixed languages
_PARAGRAPH = re.compile(r'<div class="para">(.*?)</div>', re.S)
_TAG = re.compile(r"<[^>]+>")
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class LabelledTexts:
    """Texts, one label per text (an index into ``classes``), and the task's name."""

    task: str
    texts: tuple[str, ...]
    labels: tuple[int, ...]
    classes: tuple[str, ...]


def labelled_texts(task: str, per_class: int = 200, n_chapters: int = 4) -> LabelledTexts:
    """The labelled texts of ``task`` (``TASKS``), at most ``per_class`` per class.

    Raises ``InputError`` for an unknown task, a bad bound, or when fewer than two classes have texts (saying how
    to install the packages).

    Example:
        >>> data = labelled_texts("code_vs_prose", per_class=3)
        >>> data.classes, data.labels
        (('code', 'prose'), (0, 0, 0, 1, 1, 1))
    """
    if task not in TASKS:
        raise InputError(f"task must be one of {TASKS}, got {task!r}")
    for name, value in (("per_class", per_class), ("n_chapters", n_chapters)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    if task == "language":
        documents = {name: _fortune_files(directory) for name, directory in LANGUAGE_DIRECTORIES.items()}
    elif task == "code_vs_prose":
        documents = {"code": _code_chunks(per_class), "prose": _prose()}
    else:
        documents = _chapters(n_chapters)
    documents = {name: texts for name, texts in documents.items() if texts}
    if len(documents) < 2:
        raise InputError(f"task {task!r} needs texts of at least two classes, found {sorted(documents)}: {INSTALL}")
    texts, labels = [], []
    for index, pool in enumerate(documents.values()):
        chosen = _evenly(pool, per_class)
        texts += chosen
        labels += [index] * len(chosen)
    return LabelledTexts(task, tuple(texts), tuple(labels), tuple(documents))


def _evenly(pool: list[str], n: int) -> list[str]:
    """``n`` documents spread over the pool (the whole pool when it is smaller): every source is represented."""
    if len(pool) <= n:
        return list(pool)
    return [pool[i * len(pool) // n] for i in range(n)]


def _clean(text: str) -> str:
    text = text.strip()
    return text[:MAX_CHARS] if len(text) >= MIN_CHARS else ""


def _fortune_files(directory: Path) -> list[str]:
    if not directory.is_dir():
        return []
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.is_symlink()
                   and p.suffix not in (".dat", ".u8") and p.name.split(".")[0] not in _SKIPPED)
    documents = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        documents += [piece for piece in (_clean(p) for p in re.split(r"^%$", text, flags=re.M)) if piece]
    return documents


def _code_chunks(per_class: int) -> list[str]:
    from workbench.corpus import stdlib_corpus

    corpus = stdlib_corpus(max_files=max(20, per_class))
    chunks = []
    for source in corpus.train:
        blocks = [_clean(block) for block in re.split(r"\n\s*\n", source.text)]
        chunks += [block for block in blocks if block]
    return chunks


def _prose() -> list[str]:
    from experiments.datasets.english import english_documents

    return [text for text in (_clean(d) for d in english_documents("all")) if text]


def _chapters(n_chapters: int) -> dict[str, list[str]]:
    pages = sorted(HANDBOOK.glob("*.html")) if HANDBOOK.is_dir() else []
    chapters = {}
    for page in pages:
        paragraphs = [_clean(_SPACE.sub(" ", html.unescape(_TAG.sub("", p))))
                      for p in _PARAGRAPH.findall(page.read_text(encoding="utf-8", errors="replace"))]
        chapters[page.stem] = [p for p in paragraphs if p]
    longest = sorted(chapters, key=lambda name: (-len(chapters[name]), name))[:n_chapters]
    return {name: chapters[name] for name in sorted(longest)}
