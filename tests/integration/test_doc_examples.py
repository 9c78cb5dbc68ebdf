"""Every Python example in the README and the docs runs as written, the way a reader pastes it.

Each markdown file's ```python blocks run in order as one script, in a fresh process whose working folder is an
empty one (so no example may lean on the checkout's own paths, such as test fixtures), offline, with the registered
and shipped models only. A block that cannot run here says so on the line above it, with its reason:
``<!-- not run: needs a Ray cluster -->``; that marker is the only way out, and a bare one is refused.

The script compiles each block under the markdown file's name, padded to the block's first line, so a traceback
names the document and the line a reader would look at.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!-- not run: (.*?) -->\s*\Z")
EXAMPLES_TIMEOUT_S = 600  # the slowest file, dictionaries.md, took 64 s on one thread; a busy machine is slower


@dataclass(frozen=True)
class Example:
    line: int  # the block's first code line in the markdown file, 1-based
    code: str
    not_run: str | None  # the reason given by the marker above the fence, or None when it runs


def examples(path: Path) -> list[Example]:
    """The ```python blocks of ``path``, each with its first line and the reason it is not run (if marked)."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = NOT_RUN.search(before)
        if "<!-- not run" in before and (marker is None or not marker[1].strip()):
            raise AssertionError(f"{path.name}: the not-run marker above line {text.count(chr(10), 0, match.start()) + 1} "
                                 "gives no reason ('<!-- not run: why -->')")
        found.append(Example(text.count("\n", 0, match.start(1)) + 1, match[1], marker[1].strip() if marker else None))
    return found


def script(path: Path, blocks: list[Example]) -> str:
    """One program running ``blocks`` in one namespace, each compiled under the markdown file's name and line."""
    name = path.relative_to(ROOT).as_posix()
    lines = ["namespace = {'__name__': '__main__'}"]
    for block in blocks:
        padded = "\n" * (block.line - 1) + block.code
        lines.append(f"print('--- {name}:{block.line}', flush=True)")
        lines.append(f"exec(compile({padded!r}, {name!r}, 'exec'), namespace)")
    return "\n".join(lines) + "\n"


def test_a_block_is_left_out_only_with_a_reason(tmp_path: Path):
    doc = tmp_path / "doc.md"
    doc.write_text("Text.\n\n<!-- not run: needs a GPU -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n")
    assert examples(doc) == [Example(5, "x = 1\n", "needs a GPU"), Example(9, "y = 2\n", None)]
    doc.write_text("<!-- not run -->\n```python\nx = 1\n```\n")
    with pytest.raises(AssertionError, match="gives no reason"):
        examples(doc)


def test_the_examples_are_found_and_every_skipped_one_says_why():
    # The README's seven blocks and the guides' run; the shape legend's blocks are notation, marked as such.
    readme = examples(ROOT / "README.md")
    assert len(readme) == 7 and all(block.not_run is None for block in readme)
    assert all(block.not_run for block in examples(ROOT / "docs" / "shapes.md"))
    guides = sorted((ROOT / "docs" / "guides").glob("*.md"))
    assert all(any(block.not_run is None for block in examples(path)) for path in guides
               if path.name not in ("dashboard.md", "performance.md"))   # those two show pages and figures


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DOCS if any(b.not_run is None for b in examples(p))],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_example_runs_as_written(path: Path, tmp_path: Path):
    program = tmp_path / "examples.py"
    program.write_text(script(path, [block for block in examples(path) if block.not_run is None]))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg", "TQDM_DISABLE": "1"}
    done = subprocess.run([sys.executable, str(program)], cwd=work, env=env, capture_output=True, text=True,
                          timeout=EXAMPLES_TIMEOUT_S)
    ran = [line for line in done.stdout.splitlines() if line.startswith("--- ")]
    assert done.returncode == 0, f"failed after {ran[-1:] or 'no block'}:\n{done.stderr[-4000:]}"
