"""Files the workbench reads or deletes are checked, and stay inside their directory.

Each test writes a hostile file itself (in tmp_path) and checks it is refused, or not trusted, with
an error naming the field, and that nothing outside the directory is read or deleted.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

import workbench as wb
from workbench.cache_store import INDEX_NAME


@pytest.fixture(scope="module")
def model():
    return wb.load_model("toy-attn-2l", progress=False)


@pytest.fixture
def written_cache(model, tmp_path):
    """A real two-shard cache of one hook (rows 0:1 and 1:2), and a function that rewrites its index."""
    directory = tmp_path / "cache"
    tokens = model.to_tokens(["The cat sat", "The dog ran"])
    model.run_with_cache(tokens, cache_dir=directory, names_filter="hook_embed", batch_size=1)
    index = json.loads((directory / INDEX_NAME).read_text())
    assert [shard["rows"] for shard in index["shards"]] == [[0, 1], [1, 2]]

    def tamper(edit):
        changed = json.loads(json.dumps(index))
        edit(changed)
        (directory / INDEX_NAME).write_text(json.dumps(changed))
        return directory
    return directory, tamper


# 1. load_cache trusts its index.json

def test_a_larger_shape_than_the_shards_hold_is_refused_before_reading(written_cache):
    _, tamper = written_cache
    directory = tamper(lambda index: index["shapes"].update(hook_embed=[2, 999, 128]))
    with pytest.raises(wb.InputError, match="shapes"):
        wb.load_cache(directory)


def test_rows_must_be_covered_exactly_once_in_order(written_cache):
    _, tamper = written_cache
    for rows in ([[0, 1], [0, 1]], [[0, 1], [1, 3]], [[1, 2], [0, 1]], [[0, 1], [-1, 2]]):
        def edit(index, rows=rows):
            for shard, span in zip(index["shards"], rows):
                shard["rows"] = span
        with pytest.raises(wb.InputError, match=r"shards\[\d\]\.rows|'shards'"):
            wb.load_cache(tamper(edit))
    with pytest.raises(wb.InputError, match="'shards' cover rows 0:1"):
        wb.load_cache(tamper(lambda index: index["shards"].pop()))


def test_a_dtype_edit_is_refused_not_cast(written_cache):
    _, tamper = written_cache
    with pytest.raises(wb.InputError, match="dtypes"):
        wb.load_cache(tamper(lambda index: index["dtypes"].update(hook_embed="float16")))
    with pytest.raises(wb.InputError, match=r"dtypes\['hook_embed'\]"):
        wb.load_cache(tamper(lambda index: index["dtypes"].update(hook_embed="Tensor")))


@pytest.mark.parametrize("file_name", ["../outside.safetensors", "/etc/passwd", "sub/shard.safetensors", ".."])
def test_a_shard_outside_the_directory_is_never_read(written_cache, file_name, tmp_path):
    directory, tamper = written_cache
    outside = tmp_path / "outside.safetensors"  # a valid shard, just outside the cache directory
    save_file({"hook_embed": torch.zeros(1, 4, 128)}, str(outside))
    with pytest.raises(wb.InputError, match=r"shards\[0\]\.file"):
        wb.load_cache(tamper(lambda index: index["shards"][0].update(file=file_name)))


@pytest.mark.parametrize("field", ["rows", "names", "shapes", "dtypes", "shards", "model"])
def test_a_missing_field_is_named_not_a_key_error(written_cache, field):
    _, tamper = written_cache
    with pytest.raises(wb.InputError, match=f"field '{field}' is missing"):
        wb.load_cache(tamper(lambda index: index.pop(field)))


def test_a_shard_swapped_after_loading_is_refused_on_read(written_cache):
    directory, _ = written_cache
    cache = wb.load_cache(directory)
    save_file({"hook_embed": torch.zeros(1, 2, 128)}, str(directory / "shard-00001.safetensors"))
    with pytest.raises(wb.InputError, match="hook_embed"):
        cache["hook_embed"]


def test_an_untampered_cache_still_loads(written_cache, model):
    directory, _ = written_cache
    assert wb.load_cache(directory)["hook_embed"].shape[0] == 2


# 2. the offload folder

DISK_MAP = {"blocks": "disk", "embed": "cpu", "ln_final": "cpu", "unembed": "cpu"}


def test_the_offload_index_has_its_own_name_and_an_activation_cache_is_not_an_offload(model, tmp_path):
    from workbench.loading.placement import OFFLOAD_INDEX
    assert OFFLOAD_INDEX != INDEX_NAME
    directory = tmp_path / "cache"
    model.run_with_cache(model.to_tokens("The cat"), cache_dir=directory, names_filter="hook_embed")
    before = {path.name: path.read_bytes() for path in directory.iterdir()}
    with pytest.raises(wb.ConfigError, match=f"offload_folder {directory}: not empty and not an earlier offload"):
        wb.load_model("toy-attn-2l", device_map=DISK_MAP, offload_folder=directory, progress=False)
    assert {path.name: path.read_bytes() for path in directory.iterdir()} == before  # the cache is untouched


def test_clearing_an_offload_deletes_only_regular_files_it_lists_inside_the_folder(tmp_path):
    from workbench.loading.placement import OFFLOAD_INDEX, prepare_offload_folder
    folder, victim = tmp_path / "offload", tmp_path / "victim.dat"
    folder.mkdir()
    victim.write_text("not ours")
    (folder / "sub").mkdir()
    (folder / "sub.dat").mkdir()                       # a folder, not a weight file
    (folder / "link.dat").symlink_to(victim)           # a link to a file outside
    (folder / "w.dat").write_bytes(b"weights")
    index = {name: {} for name in ("../victim", str(tmp_path / "victim"), "sub/../../victim", "sub", "link", "w")}
    (folder / OFFLOAD_INDEX).write_text(json.dumps(index))
    assert prepare_offload_folder(folder, {"blocks.0": "disk"}) == folder
    assert victim.read_text() == "not ours"
    assert sorted(path.name for path in folder.iterdir()) == ["link.dat", "sub", "sub.dat"]


def test_an_offload_into_the_same_folder_still_replaces_the_earlier_one(tmp_path):
    from workbench.loading.placement import OFFLOAD_INDEX
    wb.load_model("toy-attn-2l", device_map=DISK_MAP, offload_folder=tmp_path, progress=False)
    model = wb.load_model("toy-attn-2l", device_map=DISK_MAP, offload_folder=tmp_path, progress=False)
    index = json.loads((tmp_path / OFFLOAD_INDEX).read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{n}.dat" for n in index] + [OFFLOAD_INDEX])
    tokens = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(model(tokens), wb.load_model("toy-attn-2l", progress=False)(tokens))


# 3. an HF shard index pointing outside its directory

@pytest.mark.parametrize("file_name", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors", 7])
def test_an_hf_shard_index_pointing_outside_its_directory_is_refused(tmp_path, monkeypatch, file_name):
    from workbench.loading.hf import checkpoint as hf_checkpoint
    outside = tmp_path / "outside.safetensors"
    save_file({"w": torch.zeros(2)}, str(outside))
    directory = tmp_path / "model"
    directory.mkdir()
    save_file({"v": torch.zeros(2)}, str(directory / "model-00001-of-00001.safetensors"))
    file_name = str(outside) if file_name == "ABSOLUTE" else file_name
    (directory / hf_checkpoint.INDEX_FILE).write_text(json.dumps(
        {"weight_map": {"v": "model-00001-of-00001.safetensors", "w": file_name}}))
    opened = []
    monkeypatch.setattr(hf_checkpoint, "_open", lambda path: opened.append(path))
    with pytest.raises(wb.CheckpointError, match=r"weight_map\['w'\]"):
        hf_checkpoint.SafetensorsCheckpoint(directory, progress=False)
    assert opened == []  # refused before any file was opened


def test_an_hf_shard_index_with_plain_names_still_loads(tmp_path):
    from workbench.loading.hf import checkpoint as hf_checkpoint
    save_file({"v": torch.ones(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / hf_checkpoint.INDEX_FILE).write_text(json.dumps({"weight_map": {"v": "model-00001-of-00001.safetensors"}}))
    assert hf_checkpoint.SafetensorsCheckpoint(tmp_path, progress=False).take("v").tolist() == [1.0, 1.0]


# 4. the Neurons disk cache trusts what it reads back

def _tampered(stored):
    """Hostile versions of a maxima file: each one must be recomputed, never returned."""
    windows_BP, max_BM, argmax_BM = stored["windows_BP"], stored["max_BM"], stored["argmax_BM"]
    wrapped = argmax_BM.clone()
    wrapped[0, 0] = -1  # would silently index the window's last token
    beyond = argmax_BM.clone()
    beyond[1, 2] = windows_BP.shape[1]
    return {
        "argmax -1": dict(stored, argmax_BM=wrapped),
        "argmax past the window": dict(stored, argmax_BM=beyond),
        "argmax as floats": dict(stored, argmax_BM=argmax_BM.float()),
        "too few neurons": dict(stored, max_BM=max_BM[:, :-1].contiguous(), argmax_BM=argmax_BM[:, :-1].contiguous()),
        "maxima as integers": dict(stored, max_BM=max_BM.long()),
        "NaN maxima": dict(stored, max_BM=max_BM.clone().fill_(float("nan"))),
        "no argmax": {"windows_BP": windows_BP, "max_BM": max_BM},
        "an extra tensor": dict(stored, extra=torch.zeros(1)),
    }


def test_a_tampered_neuron_maxima_file_is_recomputed_not_trusted(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from experiments.neurons import windows
    from experiments.neurons.units import MLPUnit
    monkeypatch.setenv(windows.CACHE_ENV, str(tmp_path))
    moe_model = wb.load_model("toy-moe-2l", progress=False)
    unit = MLPUnit(1, expert=3)
    computed = windows.corpus_maxima(moe_model, unit, n_windows=4, window=32)
    assert not computed.from_disk and computed.path.is_file()
    assert windows.corpus_maxima(moe_model, unit, n_windows=4, window=32).from_disk  # an honest file is used
    stored = load_file(str(computed.path))
    for what, hostile in _tampered(stored).items():
        save_file(hostile, str(computed.path))
        again = windows.corpus_maxima(moe_model, unit, n_windows=4, window=32)
        assert not again.from_disk, what
        assert torch.equal(again.argmax_BM, computed.argmax_BM) and torch.equal(again.max_BM, computed.max_BM), what
        assert windows.corpus_maxima(moe_model, unit, n_windows=4, window=32).from_disk, what  # rewritten honestly
