"""Where a model's shipped tuned lens lives: a lens row of ``wb.shipped`` (``workbench/zoo/<model>/lenses/<name>/``,
tuned-lens 0.2's files with a ``CARD.md`` beside them), looked up inside the zoo only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from workbench.shipped import shipped


def shipped_tuned_lens(model_name: Optional[str]) -> Optional[Path]:
    """The folder of the tuned lens shipped for the registered model ``model_name``, or None (none ships, or the name
    is not a registered model: a Hub id or a path).

    Example:
        >>> shipped_tuned_lens("toy-attn-2l") is None, shipped_tuned_lens("../etc") is None
        (True, True)
        >>> shipped_tuned_lens("smollm2-135m").name
        'smollm2-135m-tuned-lens'
    """
    if not isinstance(model_name, str) or not model_name:
        return None
    for path in shipped(kind="lens", model=model_name)["path"]:
        if (Path(path) / "config.json").is_file() and (Path(path) / "params.pt").is_file():
            return Path(path)
    return None
