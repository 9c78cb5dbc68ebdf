"""run_with_cache over a dataset in batches, streamed to disk: read back one hook at a time, only the hooks asked
for, nothing left behind by a failure, and one batch held in memory rather than the dataset.

Every expected value is a plain one-shot ``run_with_cache`` over all the rows, or a hand calculation (byte counts).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import workbench as wb
import workbench.cache_store as cache_store
from tests.unit.batched_cache_setup import assert_same_cache, dataset, make_model, no_hooks_left, one_shot

ROOT = Path(__file__).resolve().parents[2]


# ---- on disk -------------------------------------------------------------------------------------------------
class CountingSafeOpen:
    """Stands in for safetensors.safe_open and records which tensors are read."""

    def __init__(self, real):
        self.real, self.read = real, []

    def __call__(self, *args, **kwargs):
        counter = self

        class Handle:
            def __enter__(self):
                self.file = counter.real(*args, **kwargs).__enter__()
                return self

            def __exit__(self, *exc):
                return self.file.__exit__(*exc)

            def get_tensor(self, name):
                counter.read.append(name)
                return self.file.get_tensor(name)

        return Handle()


@pytest.mark.parametrize("padding", [None, "right"])
def test_streamed_cache_reads_back_one_hook_at_a_time(tmp_path, monkeypatch, padding):
    model = make_model()
    tokens, mask = dataset(padding)
    expected_logits, expected = one_shot(model, tokens, mask)
    directory = tmp_path / "new" / "acts"  # parents created too
    logits, cache = model.run_with_cache(tokens, attention_mask=mask, batch_size=3, cache_dir=directory,
                                         progress=False)
    assert (logits - expected_logits).abs().max() < 1e-5
    shards = sorted(p.name for p in directory.glob("shard-*.safetensors"))
    assert shards == ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    index = json.loads((directory / "index.json").read_text())
    assert [s["rows"] for s in index["shards"]] == [[0, 3], [3, 6], [6, 7]]
    assert sorted(p.name for p in directory.iterdir()) == ["index.json", *shards]  # no temporary files

    counter = CountingSafeOpen(cache_store.safe_open)
    monkeypatch.setattr(cache_store, "safe_open", counter)
    assert len(cache) == len(expected) and "hook_embed" in cache and ("pattern", 0) not in cache.cache_dict
    assert sorted(cache.keys()) == sorted(expected.keys()) and counter.read == []
    resid = cache["blocks.0.hook_resid_post"]
    assert counter.read == ["blocks.0.hook_resid_post"] * len(shards)  # that hook, once per shard, nothing else
    assert (resid - expected["blocks.0.hook_resid_post"]).abs().max() < 1e-5
    assert torch.equal(cache["pattern", 0], cache["blocks.0.attn.hook_pattern"])
    monkeypatch.setattr(cache_store, "safe_open", counter.real)
    assert_same_cache(cache, expected)

    reopened = wb.load_cache(directory, model)
    assert_same_cache(reopened, expected)
    assert (reopened.accumulated_resid() - expected.accumulated_resid()).abs().max() < 1e-5
    assert (reopened.stack_activation("pattern") - expected.stack_activation("pattern")).abs().max() < 1e-5
    without_model = wb.load_cache(str(directory))
    # Batches of three rows against one of seven: equal to float rounding, not bitwise (GEMM blockings differ).
    torch.testing.assert_close(without_model["pattern", 1], expected["pattern", 1], rtol=0, atol=1e-6)


def test_a_filtered_cache_on_disk_keeps_only_its_hooks(tmp_path):
    model = make_model()
    tokens, mask = dataset("left")
    names = lambda n: n.endswith(("hook_resid_pre", "hook_resid_post"))  # noqa: E731
    _, expected = one_shot(model, tokens, mask, names)
    _, cache = model.run_with_cache(tokens, attention_mask=mask, names_filter=names, batch_size=4,
                                    cache_dir=tmp_path / "c", return_type=None, progress=False)
    assert_same_cache(cache, expected)
    assert (cache.accumulated_resid() - expected.accumulated_resid()).abs().max() < 1e-5
    assert (cache.stack_activation("resid_post") - expected.stack_activation("resid_post")).abs().max() < 1e-5


def test_load_cache_refuses_what_is_not_a_cache(tmp_path):
    model = make_model()
    with pytest.raises(wb.InputError, match="no index.json"):
        wb.load_cache(tmp_path)
    tokens, _ = dataset(None)
    model.run_with_cache(tokens, batch_size=4, cache_dir=tmp_path / "c", names_filter="hook_embed", progress=False)
    other = wb.Decoder(model.cfg.replace(d_model=64))
    with pytest.raises(wb.InputError, match="d_model 32 there, 64 here"):
        wb.load_cache(tmp_path / "c", other)
    (tmp_path / "c" / "shard-00001.safetensors").unlink()
    with pytest.raises(wb.InputError, match="shard-00001"):
        wb.load_cache(tmp_path / "c")


def test_rows_read_across_shards_are_the_one_shot_rows_and_only_from_their_shards(tmp_path, monkeypatch):
    model = make_model()
    tokens, _ = dataset(None)
    names = ["hook_embed", "blocks.0.hook_resid_post"]
    _, expected = one_shot(model, tokens, None, names)
    _, cache = model.run_with_cache(tokens, batch_size=3, cache_dir=tmp_path / "c", names_filter=names,
                                    return_type=None, progress=False)  # shards of rows 0:3, 3:6, 6:7
    opened = []
    real = cache_store.safe_open
    monkeypatch.setattr(cache_store, "safe_open", lambda path, **kw: opened.append(Path(path).name) or real(path, **kw))
    rows = cache.cache_dict.read_rows(names, 2, 5)
    assert opened == ["shard-00000.safetensors", "shard-00001.safetensors"]  # not the third shard
    for name in names:
        assert (rows[name] - expected[name][2:5]).abs().max() < 1e-5
    with pytest.raises(wb.InputError, match="holds no activations of \\['hook_mlp_out'\\]"):
        cache.cache_dict.read_rows(["hook_mlp_out"], 0, 1)
    with pytest.raises(wb.InputError, match="rows 5:8 .* not within its 7 rows"):
        cache.cache_dict.read_rows(names, 5, 8)


def test_a_shard_changed_after_opening_is_refused_by_the_row_reader(tmp_path):
    model = make_model()
    tokens, _ = dataset(None)
    _, cache = model.run_with_cache(tokens, batch_size=3, cache_dir=tmp_path / "c", names_filter="hook_embed",
                                    return_type=None, progress=False)
    shard = tmp_path / "c" / "shard-00001.safetensors"
    cache_store.save_file({"hook_embed": torch.zeros(2, 1)}, str(shard))  # two rows of width 1: not what was indexed
    with pytest.raises(wb.InputError, match="shard-00001.safetensors.*'hook_embed' is torch.float32 \\[2, 1\\].*the file changed"):
        cache.cache_dict.read_rows(["hook_embed"], 0, 7)


def test_load_cache_refuses_a_shard_linked_from_outside(tmp_path):
    model = make_model()
    tokens, _ = dataset(None)
    model.run_with_cache(tokens, batch_size=4, cache_dir=tmp_path / "c", names_filter="hook_embed", progress=False)
    shard = tmp_path / "c" / "shard-00000.safetensors"
    shard.rename(tmp_path / "outside.safetensors")
    shard.symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(wb.CheckpointError, match="resolves outside the activation cache"):
        wb.load_cache(tmp_path / "c")


# ---- failures leave nothing behind ---------------------------------------------------------------------------
class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("existing", [False, True])
def test_a_hook_raising_mid_stream_leaves_no_files_and_no_hooks(tmp_path, error, existing):
    model = make_model()
    tokens, _ = dataset(None)
    directory = tmp_path / "acts"
    if existing:
        directory.mkdir()
    calls = []

    def raise_on_second_batch(tensor, hook):
        calls.append(1)
        if len(calls) == 2:
            raise error("second batch")

    model.add_hook("blocks.1.hook_resid_post", raise_on_second_batch)
    with pytest.raises(error):
        model.run_with_cache(tokens, batch_size=3, cache_dir=directory, progress=False)
    attached = {name: len(hp.fwd_hooks) + len(hp.bwd_hooks) for name, hp in model.hook_dict.items()}
    assert {name: n for name, n in attached.items() if n} == {"blocks.1.hook_resid_post": 1}  # the caller's own only
    assert (directory.exists() and list(directory.iterdir()) == []) if existing else not directory.exists()
    assert list(tmp_path.iterdir()) == ([directory] if existing else [])


def test_a_failing_disk_write_leaves_no_files(tmp_path, monkeypatch):
    model = make_model()
    tokens, _ = dataset(None)
    real_save, saved = cache_store.save_file, []

    def save_then_fail(tensors, path):
        saved.append(path)
        if len(saved) == 2:
            real_save(tensors, path)  # a half-written temporary file, then the disk is full
            raise OSError(28, "No space left on device")
        real_save(tensors, path)

    monkeypatch.setattr(cache_store, "save_file", save_then_fail)
    with pytest.raises(OSError, match="No space"):
        model.run_with_cache(tokens, batch_size=3, cache_dir=tmp_path / "a" / "b", progress=False)
    assert list(tmp_path.iterdir()) == [] and no_hooks_left(model)


# ---- bounded memory ------------------------------------------------------------------------------------------
PEAK_CONFIG = dict(n_layers=1, d_model=32, n_heads=16, d_vocab=64, n_ctx=256, attn_only=True)
PEAK_NAMES = ("hook_resid_post", "hook_pattern")
PEAK_SCRIPT = f"""
import resource, sys, torch
import workbench as wb
torch.manual_seed(0)
torch.set_num_threads(1)  # two of these run side by side
model = wb.Decoder(wb.ModelConfig(**{PEAK_CONFIG!r})).eval()
tokens = torch.randint(0, 64, (int(sys.argv[1]), 256))
model.run_with_cache(tokens, names_filter=lambda n: n.endswith({PEAK_NAMES!r}), batch_size=5,
                     cache_dir=sys.argv[2], return_type=None, progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is in KiB on Linux only")
def test_streaming_to_disk_holds_one_batch_not_the_dataset(tmp_path):
    rows = 100
    model = wb.Decoder(wb.ModelConfig(**PEAK_CONFIG))
    full = wb.cache_size(model, torch.zeros(rows, 256, dtype=torch.long), lambda n: n.endswith(PEAK_NAMES))
    # By hand, per row: the pattern 16 heads x 256 x 256 x 4 bytes = 4 MiB, resid_post 256 pos x
    # 32 d_model x 4 bytes = 32 KiB; a batch of 5 rows ~20 MiB, all 100 rows ~403 MiB.
    assert full == rows * (16 * 256 * 256 * 4 + 256 * 32 * 4) == 422_707_200
    # The same script over one batch and over all 100 rows (20 batches), side by side.
    runs = {n: subprocess.Popen([sys.executable, "-c", PEAK_SCRIPT, str(n), str(tmp_path / str(n))], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (5, rows)}
    peaks = {}
    for n, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        peaks[n] = int(out.strip().splitlines()[-1])
    assert len(list((tmp_path / str(rows)).glob("shard-*.safetensors"))) == 20
    assert sum(p.stat().st_size for p in (tmp_path / str(rows)).glob("shard-*")) > full
    assert peaks[rows] - peaks[5] < 0.25 * full, (peaks, full)
