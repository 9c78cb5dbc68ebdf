"""Every package's docstring lists its modules: each submodule and subpackage of a package under ``workbench``,
``experiments`` and ``app`` is named in that package's ``__init__`` docstring, so a reader opening a package
learns what is in it and where each job lives.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("workbench", "experiments", "app")


def packages() -> list[Path]:
    return sorted(init.parent for top in PACKAGES for init in (ROOT / top).rglob("__init__.py"))


def members(package: Path) -> list[str]:
    """The names a package's docstring must mention: its modules and its subpackages. ``__init__`` and
    ``__main__`` aside: the one is the docstring's own file, the other the package's command (``python -m``)."""
    modules = [path.stem for path in package.glob("*.py") if path.stem not in ("__init__", "__main__")]
    subpackages = [path.name for path in package.iterdir() if (path / "__init__.py").is_file()]
    return sorted(modules + subpackages)


def missing_from_docstring(package: Path) -> list[str]:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return [name for name in members(package) if not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", docstring)]


def test_every_package_docstring_names_its_modules():
    missing = {}
    for package in packages():
        name = package.relative_to(ROOT).as_posix()
        if gaps := missing_from_docstring(package):
            missing[name] = gaps
    assert not missing, f"package docstrings that do not name these modules: {missing}"

