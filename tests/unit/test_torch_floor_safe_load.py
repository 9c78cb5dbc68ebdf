"""pyproject.toml's torch floor is a release where ``torch.load(weights_only=True)`` is safe to use on files a user
did not write (2.10 or later: earlier releases had escapes from the restricted unpickler), and the range stays open
above it for GPU users."""

import re
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _torch_requirement() -> str:
    # A regex rather than tomllib: the project supports Python 3.10, which has no tomllib.
    (torch_line,) = re.findall(r'^\s*"(torch[<>=!~ ][^"]*)"', PYPROJECT.read_text(), flags=re.MULTILINE)
    return torch_line


def test_torch_floor_is_a_release_where_weights_only_load_is_safe():
    floor = re.search(r">=\s*(\d+)\.(\d+)", _torch_requirement())
    assert floor is not None, _torch_requirement()
    assert (int(floor.group(1)), int(floor.group(2))) >= (2, 10)


def test_torch_range_stays_open_above_the_floor():
    assert "<" not in _torch_requirement() and "==" not in _torch_requirement()
