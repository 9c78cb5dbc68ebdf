"""No Python module over 400 lines in ``workbench``, ``experiments``, ``app`` or ``tests``: a module that grows
past it holds more than one job and is split into modules with one job each.

The Triton kernel is the one exception: one kernel's forward and backward passes, whose launch code and block
loops belong together.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("workbench", "experiments", "app", "tests")
MAX_LINES = 400
EXEMPT = {"workbench/kernels/triton_flash.py"}


def line_count(path: Path) -> int:
    with path.open(encoding="utf-8") as handle:
        return sum(1 for _ in handle)


def test_no_module_is_over_the_line_limit():
    too_long = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in EXEMPT:
                continue
            if (lines := line_count(path)) > MAX_LINES:
                too_long[name] = lines
    assert not too_long, f"modules over {MAX_LINES} lines (split each into modules with one job): {too_long}"


def test_the_exemptions_are_still_needed():
    """An exempt module that has shrunk under the limit leaves the lists, so they never hide a new one."""
    for name in EXEMPT:
        assert line_count(ROOT / name) > MAX_LINES, f"{name} is within {MAX_LINES} lines: drop it from EXEMPT"
