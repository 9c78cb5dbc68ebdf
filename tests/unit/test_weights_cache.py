"""The weights cache (``workbench.loading.weights_cache``): a GGUF file's second load reads the entry its first
wrote and gives bit-equal logits; a changed source or converter, and a truncated or tampered entry, are
converted again (never loaded); a cache that cannot be written costs the slow path and leaves nothing behind;
two processes loading at once leave one good entry.

Whether a load converted is counted on ``read_tensors`` (the one place a GGUF's tensors are dequantised), never
timed."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest
import torch

import workbench as wb
from tests.integration.gguf_tiny import tiny_llama, write_gguf
from workbench.loading import entry_stamps, weights_cache
from workbench.loading.gguf import loader as gguf_loader

ROOT = Path(__file__).resolve().parents[2]
TEXT = "the cat in the hat"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache root for the test (``$WORKBENCH_CACHE_DIR``); the entries go to its ``weights/``."""
    root = tmp_path / "cache"
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(root))
    monkeypatch.delenv(weights_cache.WEIGHTS_CACHE_ENV, raising=False)
    return root


@pytest.fixture
def conversions(monkeypatch) -> list[str]:
    """The GGUF files dequantised from now on, one item per ``read_tensors`` call."""
    calls: list[str] = []
    real = gguf_loader.read_tensors

    def counted(file, cfg, progress=None):
        calls.append(file.path.name)
        return real(file, cfg, progress)

    monkeypatch.setattr(gguf_loader, "read_tensors", counted)
    return calls


@pytest.fixture
def source(tmp_path) -> Path:
    return write_gguf(tiny_llama(), tmp_path / "tiny.gguf")


def entries(cache: Path) -> list[Path]:
    folder = cache / "weights"
    return sorted(folder.iterdir()) if folder.exists() else []


def logits(model) -> torch.Tensor:
    return model(model.to_tokens(TEXT))


def data_region(path: Path) -> tuple[int, int]:
    """(start, end) of a safetensors file's tensor bytes: after its 8-byte length and JSON header."""
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    return 8 + header_length, path.stat().st_size


def test_a_second_load_reads_the_cache_and_gives_bit_equal_logits(cache, conversions, source):
    first = wb.load_model(source)
    [entry] = entries(cache)
    second = wb.load_model(source)
    assert conversions == ["tiny.gguf"]  # the second load dequantised nothing
    assert torch.equal(logits(second), logits(first))
    assert second.cfg == first.cfg and second.config.model_name == "tiny-llama"
    assert second.tokenizer.encode(TEXT) == first.tokenizer.encode(TEXT)
    assert second.tokenizer.bos_token_id == first.tokenizer.bos_token_id == 1
    assert entries(cache) == [entry]


def test_one_entry_serves_every_dtype(cache, conversions, source):
    """The entry holds the float32 conversion; the dtype is applied after it, so a cached bfloat16 load equals
    an uncached one."""
    wb.load_model(source)
    cached = wb.load_model(source, dtype=torch.bfloat16)
    uncached = wb.load_model(source, dtype=torch.bfloat16, weights_cache=False)
    assert conversions == ["tiny.gguf", "tiny.gguf"]  # the first load and the uncached one
    assert cached.cfg.dtype == torch.bfloat16 and torch.equal(logits(cached), logits(uncached))


@pytest.mark.parametrize("same_mtime", [False, True], ids=["rewritten", "rewritten-with-its-old-mtime"])
def test_a_changed_source_is_converted_again(cache, conversions, source, same_mtime):
    """Different bytes, same size: seen by the mtime, or (mtime put back) by the content fingerprint."""
    first = wb.load_model(source)
    before = os.stat(source)
    norm = next(t for t in gguf.GGUFReader(str(source)).tensors if t.name == "output_norm.weight")
    data = bytearray(source.read_bytes())
    data[norm.data_offset] ^= 0x01  # the lowest mantissa byte of the final norm's first gain
    source.write_bytes(bytes(data))
    if same_mtime:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(source).st_size == before.st_size
    changed = wb.load_model(source)
    assert conversions == ["tiny.gguf", "tiny.gguf"]
    assert not torch.equal(logits(changed), logits(first))
    assert torch.equal(logits(changed), logits(wb.load_model(source, weights_cache=False)))


@pytest.mark.parametrize("change", ["format version", "conversion code"])
def test_a_changed_converter_is_converted_again(cache, conversions, source, monkeypatch, change):
    first = wb.load_model(source)
    [old] = entries(cache)
    if change == "format version":
        monkeypatch.setattr(weights_cache, "FORMAT_VERSION", weights_cache.FORMAT_VERSION + 1)
    else:  # what an edit of the conversion code does to its digest
        monkeypatch.setattr(weights_cache, "CONVERSION_CODE", weights_cache.CONVERSION_CODE + ("workbench.errors",))
    again = wb.load_model(source)
    assert conversions == ["tiny.gguf", "tiny.gguf"] and torch.equal(logits(again), logits(first))
    assert len(entries(cache)) == 2 and old in entries(cache)  # the old one is kept for the other version
    wb.load_model(source)
    assert len(conversions) == 2  # the new entry is read


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def flip_tensor_bytes(path: Path) -> None:
    start, end = data_region(path)
    data = bytearray(path.read_bytes())
    middle = (start + end) // 2
    data[middle:middle + 4] = bytes(b ^ 0xFF for b in data[middle:middle + 4])
    path.write_bytes(bytes(data))


def change_the_stored_config(path: Path) -> None:
    """One digit of the config in the header (same length, still valid JSON): only the digest can tell."""
    data = path.read_bytes()
    assert data.count(b'"n_layers\\": 2') == 1
    path.write_bytes(data.replace(b'"n_layers\\": 2', b'"n_layers\\": 1'))


@pytest.mark.parametrize("damage", [truncate, flip_tensor_bytes, change_the_stored_config],
                         ids=["truncated", "tensor-bytes-flipped", "config-changed"])
def test_a_damaged_entry_is_converted_again_never_loaded(cache, conversions, source, damage):
    first = wb.load_model(source)
    [entry] = entries(cache)
    damage(entry)
    with pytest.warns(RuntimeWarning, match="weights cache entry not used"):
        again = wb.load_model(source)
    assert conversions == ["tiny.gguf", "tiny.gguf"]  # converted again: the damaged entry was not used
    assert again.cfg.n_layers == 2 and torch.equal(logits(again), logits(first))
    assert entries(cache) == [entry]  # replaced by a good one, which the next load reads
    assert torch.equal(logits(wb.load_model(source)), logits(first)) and len(conversions) == 2


@pytest.fixture
def hashes(monkeypatch) -> list[int]:
    """Entry digests computed from now on (a write's and a read's check), one item each; stamps made at once
    (no two-second wait for a settled file)."""
    calls: list[int] = []
    real = weights_cache._content_digest

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(weights_cache, "_content_digest", counted)
    monkeypatch.setattr(entry_stamps, "SETTLED_SECONDS", 0.0)
    return calls


def test_a_checked_unchanged_entry_is_not_hashed_again(cache, conversions, source, hashes):
    first = wb.load_model(source)  # converts and writes: one digest
    second = wb.load_model(source)  # reads: checks the digest and stamps the entry
    third = wb.load_model(source)  # the stamp matches the unchanged file: no digest
    assert conversions == ["tiny.gguf"] and len(hashes) == 2
    assert torch.equal(logits(third), logits(first)) and torch.equal(logits(second), logits(first))
    assert third.tokenizer.encode(TEXT) == first.tokenizer.encode(TEXT)


@pytest.mark.parametrize("damage", [truncate, flip_tensor_bytes, change_the_stored_config],
                         ids=["truncated", "tensor-bytes-flipped", "config-changed"])
def test_a_stamped_entry_damaged_later_is_still_converted_again(cache, conversions, source, hashes, damage):
    first = wb.load_model(source)
    wb.load_model(source)  # stamps the entry
    [entry] = entries(cache)
    damage(entry)
    with pytest.warns(RuntimeWarning, match="weights cache entry not used"):
        again = wb.load_model(source)
    assert conversions == ["tiny.gguf", "tiny.gguf"] and torch.equal(logits(again), logits(first))


def full_disk(monkeypatch):
    def half_written(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(weights_cache, "save_file", half_written)


def cache_root_is_a_file(cache: Path):
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("not a directory")


def read_only(cache: Path):
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    (cache / "weights").mkdir(parents=True)
    (cache / "weights").chmod(0o555)


@pytest.mark.parametrize("unwritable", ["full disk", "cache root is a file", "read-only folder"])
def test_a_cache_that_cannot_be_written_costs_the_slow_path_only(cache, conversions, source, monkeypatch, unwritable):
    expected = logits(wb.load_model(source, weights_cache=False))
    if unwritable == "full disk":
        full_disk(monkeypatch)
    elif unwritable == "cache root is a file":
        cache_root_is_a_file(cache)
    else:
        read_only(cache)
    with pytest.warns(RuntimeWarning, match="weights cache not written"):
        model = wb.load_model(source)
    assert torch.equal(logits(model), expected)
    assert (entries(cache) if cache.is_dir() else []) == []  # no entry, no partial file, no temporary


def test_the_cache_can_be_turned_off(cache, conversions, source, monkeypatch):
    wb.load_model(source, weights_cache=False)
    monkeypatch.setenv(weights_cache.WEIGHTS_CACHE_ENV, "0")
    wb.load_model(source)
    assert entries(cache) == [] and len(conversions) == 2
    monkeypatch.delenv(weights_cache.WEIGHTS_CACHE_ENV)
    wb.load_model(source)
    wb.load_model(source, weights_cache=False)  # an entry exists: still converted, as asked
    assert len(entries(cache)) == 1 and len(conversions) == 4


def test_a_bad_option_fails_before_a_cached_tensor_is_read(cache, source, monkeypatch):
    wb.load_model(source)
    monkeypatch.setattr(weights_cache, "load_file", lambda *a, **k: pytest.fail("tensors read before the check"))
    with pytest.raises(wb.ConfigError, match=r"attn_impl must be one of .*got 'fast'"):
        wb.load_model(source, attn_impl="fast")


def test_an_entry_whose_source_is_gone_is_removed_when_another_is_written(cache, tmp_path):
    gone = write_gguf(tiny_llama(), tmp_path / "gone.gguf")
    wb.load_model(gone)
    gone.unlink()
    wb.load_model(write_gguf(tiny_llama(seed=1), tmp_path / "other.gguf"))
    assert [p.name.split("-")[0] for p in entries(cache)] == ["other.gguf"]


LOADER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    import workbench as wb
    from workbench.loading.gguf import loader
    real, calls = loader.read_tensors, []
    def slow(*args, **kwargs):  # both processes are converting when either writes
        calls.append(1)
        time.sleep(1.0)
        return real(*args, **kwargs)
    loader.read_tensors = slow
    source, ready, me, other = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    (ready / me).touch()
    while not (ready / other).exists():
        time.sleep(0.01)
    model = wb.load_model(source)
    print(len(calls), model(model.to_tokens("the cat in the hat")).sum().item())
""")


def test_two_processes_loading_at_once_leave_one_good_entry(cache, conversions, source, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen([sys.executable, "-c", LOADER, str(source), str(ready), me, other], cwd=ROOT,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for me, other in (("a", "b"), ("b", "a"))]
    outputs = [process.communicate(timeout=300) for process in processes]
    assert [p.returncode for p in processes] == [0, 0], [err[-2000:] for _, err in outputs]
    results = [out.split() for out, _ in outputs]
    assert [calls for calls, _ in results] == ["1", "1"]  # each converted: both wrote
    [entry] = entries(cache)  # one entry, no temporary beside it
    assert entry.suffix == ".safetensors"
    model = wb.load_model(source)
    assert conversions == []  # the entry they left is read, intact
    assert {total for _, total in results} == {str(logits(model).sum().item())}
    expected = json.loads(json.dumps(weights_cache.entry_key(source, "gguf")))
    assert entry == weights_cache.entry_path(source, expected)
