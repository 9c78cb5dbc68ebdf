"""A single-letter axis in a jaxtyping annotation means what docs/shapes.md says it means: the file that uses it
declares it in its ``Legend:`` line (whose entries ``test_docs`` holds to docs/shapes.md), so no file can use a
letter for something else (``F`` once meant a transcoder's features in one file and ``word_embed_proj_dim`` in
another). Axes that are not one letter are spelled-out names (``node``, ``d_model``) and need no legend."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_docs import legend_lines

ROOT = Path(__file__).resolve().parents[2]
ANNOTATION = re.compile(r'\b(?:Float|Int|Bool|Shaped|Num|Integer)\[\s*[\w.]+\s*,\s*"([^"]*)"\s*\]')


def single_letter_axes(source: str) -> set[str]:
    axes = set()
    for match in ANNOTATION.finditer(source):
        for axis in match[1].split():
            axis = axis.lstrip("*#_")
            if len(axis) == 1 and axis.isalpha():
                axes.add(axis)
    return axes


def declared_letters(path: Path) -> set[str]:
    return {entry.split()[0] for _, entries in legend_lines(path) for entry in entries if entry}


def test_the_annotation_reader_finds_single_letters_only():
    source = 'x: Float[Tensor, "B P d_model"], y: Int[Tensor, "*batch n_layers k"], z: Bool[torch.Tensor, "node"]'
    assert single_letter_axes(source) == {"B", "P", "k"}


def test_every_single_letter_axis_is_declared_in_its_files_legend():
    undeclared = {}
    for top in ("workbench", "experiments", "app"):
        for file in sorted((ROOT / top).rglob("*.py")):
            if missing := single_letter_axes(file.read_text(encoding="utf-8")) - declared_letters(file):
                undeclared[file.relative_to(ROOT).as_posix()] = sorted(missing)
    assert not undeclared, ("axes annotated without a 'Legend:' line declaring them (docs/shapes.md's letters; or "
                            f"spell the axis out): {undeclared}")
