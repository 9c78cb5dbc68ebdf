"""What every SAEBench measure shares: the per-seed disk cache and the table of a measure over seeds with its spread.

A seed's result is one JSON file under ``cache_directory()/saebench/``, named by the digest of its key (the
measure's engine version, model, SAE, data and settings); the key is stored in the file and checked on reading,
and a missing, unreadable or foreign file is recomputed (written through ``save_files``: never half-written).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import pandas as pd

from workbench.cache_dir import cache_directory
from workbench.safe_files import inside, save_files


def cache_path(kind: str, key: str) -> Path:
    """The cache file of one seed's result of measure ``kind`` under ``key``.

    Example:
        >>> cache_path("core", "{}").name.startswith("core-")
        True
    """
    return cache_directory() / "saebench" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def read_cached(path: Path, key: str, required: Sequence[str]) -> Optional[dict[str, Any]]:
    """The stored result under ``key`` holding every name in ``required``, else None.

    Example:
        >>> read_cached(cache_path("core", "nothing stored"), "nothing stored", ("l0",)) is None
        True
    """
    try:
        stored = json.loads(inside(path.parent, path.name, must_exist=True, what="cache").read_text())
    except (OSError, ValueError):  # CheckpointError is a ValueError
        return None
    if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get("result"), dict):
        return None
    result = stored["result"]
    return result if all(name in result for name in required) else None


def write_cached(path: Path, key: str, result: dict[str, Any]) -> None:
    """Stores ``result`` under ``key`` (a read-only or full cache directory keeps it in memory only).

    Example:
        >>> path = cache_path("doc", "k"); write_cached(path, "k", {"x": 1.0}); read_cached(path, "k", ("x",))
        {'x': 1.0}
    """
    text = json.dumps({"key": key, "result": result})  # NaN is written as JSON's NaN, which json reads back
    try:
        save_files(path.parent, {path.name: lambda temporary: temporary.write_text(text)}, what="cache")
    except OSError:
        pass


def per_seed(kind: str, key_of: Callable[[int], dict[str, Any]], seeds: Sequence[int], required: Sequence[str],
             compute: Callable[[int], dict[str, Any]], use_disk: bool) -> list[dict[str, Any]]:
    """Each seed's result: read from the cache under ``key_of(seed)``, else ``compute(seed)`` and stored.

    Example:
        >>> per_seed("doc", lambda s: {"seed": s}, (0, 1), ("x",), lambda s: {"x": float(s)}, use_disk=False)
        [{'x': 0.0}, {'x': 1.0}]
    """
    results = []
    for seed in seeds:
        key = json.dumps(key_of(seed), sort_keys=True)
        path = cache_path(kind, key)
        stored = read_cached(path, key, required) if use_disk else None
        if stored is None:
            stored = compute(seed)
            if use_disk:
                write_cached(path, key, stored)
        results.append(stored)
    return results


def spread_table(seeds: Sequence[int], results: list[dict[str, Any]], names: Sequence[str]) -> pd.DataFrame:
    """One row per measure name (index ``measure``): ``value`` (mean over the seeds whose value is a number),
    ``std`` (their sample standard deviation; 0 for one seed) and ``seed_<s>``.

    Example:
        >>> spread_table((0, 1), [{"a": 1.0}, {"a": 3.0}], ("a",)).round(3).to_dict("records")
        [{'value': 2.0, 'std': 1.414, 'seed_0': 1.0, 'seed_1': 3.0}]
    """
    rows = []
    for name in names:
        values = [float(result[name]) for result in results]
        finite = [v for v in values if not math.isnan(v)]
        mean = sum(finite) / len(finite) if finite else float("nan")
        std = (math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1)) if len(finite) > 1
               else (0.0 if finite else float("nan")))
        rows.append({"measure": name, "value": mean, "std": std, **{f"seed_{s}": v for s, v in zip(seeds, values)}})
    return pd.DataFrame(rows).set_index("measure")
