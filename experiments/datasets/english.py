"""English prose that Debian packages ship: the training and held-out text of the shipped SmolLM2 SAE.

Two packages, both installed by ``make setup-corpus`` (``apt-get install fortunes debian-handbook``):

- ``fortunes``: the classic fortune-cookie files (``/usr/share/games/fortunes``): quotations, literature,
  jokes, songs, science, law; each fortune (text between ``%`` lines) is one document. The ascii-art and
  untranslated files are left out.
- ``debian-handbook``: *The Debian Administrator's Handbook* (GPL-2+ / CC-BY-SA), a book in English prose;
  its paragraphs (``<div class="para">`` of the en-US HTML pages, tags stripped) grouped per page are
  documents. Code listings and screen output are not paragraphs, so they are left out.

``english_documents(split)`` splits deterministically by document: every ``HELD_OUT_EVERY``-th document is
held out (``split="held_out"``), the rest are ``split="train"``, so a held-out evaluation never sees training text.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Optional

from workbench.errors import InputError

FORTUNES = Path("/usr/share/games/fortunes")
HANDBOOK = Path("/usr/share/doc/debian-handbook/html/en-US")
INSTALL = "apt-get install fortunes debian-handbook (or `make setup-corpus`)"
SKIPPED_FORTUNES = ("art", "ascii-art", "translate-me")  # pictures drawn in characters; untranslated text
HELD_OUT_EVERY = 10
SPLITS = ("train", "held_out", "all")
_PARAGRAPH = re.compile(r'<div class="para">(.*?)</div>', re.S)
_TAG = re.compile(r"<[^>]+>")
_SPACE = re.compile(r"\s+")


def english_documents(split: str = "train", max_documents: Optional[int] = None) -> list[str]:
    """The English documents of the installed Debian packages (fortunes, then the handbook's pages), split.

    ``split``: ``"train"`` (nine documents in ten), ``"held_out"`` (every tenth) or ``"all"``. Raises
    ``InputError`` for an unknown split and when a package is not installed (saying how to install it).

    Example:
        >>> docs = english_documents("held_out", max_documents=3)  # doctest: +SKIP
        >>> len(docs), all(isinstance(d, str) and d for d in docs)  # doctest: +SKIP
        (3, True)
    """
    if split not in SPLITS:
        raise InputError(f"split must be one of {SPLITS}, got {split!r}")
    documents = _fortunes() + _handbook_pages()
    if split != "all":
        keep_held_out = split == "held_out"
        documents = [d for i, d in enumerate(documents) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == keep_held_out]
    return documents[:max_documents]


def _fortunes() -> list[str]:
    files = sorted(p for p in FORTUNES.glob("*") if p.is_file() and not p.suffix and p.name not in SKIPPED_FORTUNES) \
        if FORTUNES.is_dir() else []
    if not files:
        raise InputError(f"no fortune files in {FORTUNES}: {INSTALL}")
    documents = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        documents += [piece.strip() for piece in re.split(r"^%$", text, flags=re.M) if piece.strip()]
    return documents


def _handbook_pages() -> list[str]:
    pages = sorted(HANDBOOK.glob("*.html")) if HANDBOOK.is_dir() else []
    if not pages:
        raise InputError(f"no handbook pages in {HANDBOOK}: {INSTALL}")
    documents = []
    for page in pages:
        paragraphs = [_SPACE.sub(" ", html.unescape(_TAG.sub("", p))).strip()
                      for p in _PARAGRAPH.findall(page.read_text(encoding="utf-8", errors="replace"))]
        text = "\n\n".join(p for p in paragraphs if p)
        if text:
            documents.append(text)
    return documents
