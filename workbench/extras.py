"""Optional dependencies: importing one, or an error that says which extra installs it.

Scaling out needs packages most users never install (``accelerate`` for device maps and disk
offload, ``ray`` for sharded sweeps); they live in the ``scale`` extra and are imported only
when a feature needs them, through ``require``, so a missing one is reported the same way
everywhere: which feature wanted it and the command that installs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# extra name -> the packages it installs (kept in step with pyproject.toml's optional-dependencies)
EXTRAS = {"scale": ("accelerate", "ray")}


class MissingExtraError(ImportError):
    """A feature needs a package from an optional extra that is not installed; the message names both.

    Example:
        >>> issubclass(MissingExtraError, ImportError)   # an ``except ImportError`` catches it too
        True
    """


def require(module: str, feature: str, extra: str = "scale") -> ModuleType:
    """``module`` imported, or a ``MissingExtraError`` naming ``feature`` and the extra to install.

    Example:
        >>> require("json", "reading JSON").dumps([1])
        '[1]'
        >>> try:
        ...     require("no_such_package_xyz", "device maps")
        ... except MissingExtraError as error:
        ...     print(error)
        device maps need the package 'no_such_package_xyz', which is not installed: pip install -e ".[scale]" (or pip install no_such_package_xyz)
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        raise MissingExtraError(f"{feature} need the package '{package}', which is not installed: "
                                f"pip install -e \".[{extra}]\" (or pip install {package})") from error
