"""Counting the tensors a reader takes out of a safetensors file (reading its header alone is not a read): the one
wrapper the "checked before read" tests of SAE and graph files share."""

from __future__ import annotations

from typing import Any


def count_tensor_reads(monkeypatch, module: Any) -> list[str]:
    """Replaces ``module.safe_open`` by a wrapper that records each ``get_tensor`` name; returns that list."""
    reads: list[str] = []
    real_safe_open = module.safe_open

    class CountingFile:
        def __init__(self, *args, **kwargs):
            self._file = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self._inner = self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_slice(self, name):
            return self._inner.get_slice(name)

        def get_tensor(self, name):
            reads.append(name)
            return self._inner.get_tensor(name)

    monkeypatch.setattr(module, "safe_open", CountingFile)
    return reads
