"""Where a model's shipped tuned lens lives: ``workbench/zoo/<model>/tuned_lens/`` (tuned-lens 0.2's files, a
``CARD.md`` beside them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from workbench.errors import CheckpointError
from workbench.loading.registry import ZOO
from workbench.safe_files import inside

FOLDER = "tuned_lens"


def shipped_tuned_lens(model_name: Optional[str]) -> Optional[Path]:
    """The folder of the tuned lens shipped for the registered model ``model_name``, or None (none ships, or the name
    is not a zoo folder: a Hub id or a path).

    Example:
        >>> shipped_tuned_lens("toy-attn-2l") is None, shipped_tuned_lens("../etc") is None
        (True, True)
    """
    if not isinstance(model_name, str) or not model_name:
        return None
    try:
        folder = inside(ZOO, Path(model_name) / FOLDER)
    except CheckpointError:
        return None
    return folder if (folder / "config.json").is_file() else None
