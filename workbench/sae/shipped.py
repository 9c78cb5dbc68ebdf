"""SAEs and transcoders shipped with the package, found by name: a view of the one table, ``wb.shipped``.

They live beside the zoo's models: ``workbench/zoo/<model>/saes/<name>/`` (a SAELens directory: ``cfg.json``,
``sae_weights.safetensors``) and ``workbench/zoo/<model>/transcoders/<name>/`` (what ``wb.load_transcoders``
reads: our ``transcoders.json`` or one SAELens transcoder directory per layer), each with a ``CARD.md`` giving
its recipe and measured quality (``workbench.shipped`` says how they are found, and keeps lookups inside the
zoo). ``wb.load_sae(name)`` loads a shipped SAE by its name; ``shipped_saes()`` lists them all, as
``wb.list_models()`` lists models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd

from workbench.shipped import shipped, shipped_folder

COLUMNS = ["name", "kind", "model", "hook_name", "architecture", "d_sae", "path"]


def shipped_saes() -> pd.DataFrame:
    """Every shipped SAE (``kind`` "sae") and transcoder set (``kind`` "transcoders"): name, model, the hook it
    reads, architecture, width, path (the rows of ``wb.shipped()`` of those kinds).

    Example:
        >>> table = wb.shipped_saes()
        >>> table.columns.tolist()
        ['name', 'kind', 'model', 'hook_name', 'architecture', 'd_sae', 'path']
    """
    table = shipped()
    return table[table.kind.isin(["sae", "transcoders"])][COLUMNS].reset_index(drop=True)


def shipped_path(name: object) -> Optional[Path]:
    """The directory of the shipped SAE named ``name`` (None when there is none, or ``name`` is a path rather
    than a name); an entry of that name that resolves outside the zoo is a ``CheckpointError``.

    Example:
        >>> shipped_path("no-such-sae") is None
        True
        >>> shipped_path("toy-attn-2l-resid1-topk").parent.name
        'saes'
    """
    return shipped_folder(name, "sae")
