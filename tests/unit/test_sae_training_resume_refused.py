"""Training checkpoints are written atomically and read back only into the run they belong to; settings that could
never make progress are refused before anything runs; activation caches are opened with the checked reader
(``workbench.load_cache``). Each refusal is an error naming the file, the field or the difference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import experiments.sae.checkpoints as checkpoints
import workbench as wb
from experiments.sae import train_sae
from workbench.cache_store import INDEX_NAME
from workbench.errors import CheckpointError, InputError

HOOK = "blocks.0.hook_resid_post"
RUN = dict(architecture="topk", d_sae=16, k=2, progress=False, training_tokens=128 * 4, train_batch_size_tokens=128,
           buffer_tokens=256, log_every=1, checkpoint_every=1)


def _model(d_model: int = 16) -> wb.Decoder:
    torch.manual_seed(0)
    return wb.Decoder(wb.ModelConfig(n_layers=2, d_model=d_model, n_heads=2, d_vocab=64, n_ctx=32)).eval()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A four-step run that left checkpoints step-1 ... step-4; its model and token rows."""
    model, tokens = _model(), torch.randint(1, 64, (16, 16), generator=torch.Generator().manual_seed(0))
    folder = tmp_path_factory.mktemp("checkpoints")
    train_sae(model, HOOK, tokens, checkpoint_dir=folder, **RUN)
    return model, tokens, folder


@pytest.fixture
def checkpoint(run, tmp_path):
    """A copy of step-2 to tamper with."""
    target = tmp_path / "step-2"
    shutil.copytree(run[2] / "step-2", target)
    return target


def tamper(folder: Path, edit) -> Path:
    state = torch.load(folder / checkpoints.STATE_FILE, weights_only=True)
    edit(state)
    torch.save(state, folder / checkpoints.STATE_FILE)
    return folder


def test_an_untampered_checkpoint_resumes(run, checkpoint):
    model, tokens, _ = run
    sae = train_sae(model, HOOK, tokens, resume_from=checkpoint, **RUN)
    assert sae.cfg.d_sae == 16


@pytest.mark.parametrize("change, difference", [
    (dict(architecture="jumprelu", k=None), "architecture 'topk' there, 'jumprelu' here"),
    (dict(k=3), "k 2 there, 3 here"),
    (dict(d_sae=32), "parameters"),
    (dict(hook_name="blocks.1.hook_resid_post"), "input_hooks ['blocks.0.hook_resid_post'] there, "
                                                 "['blocks.1.hook_resid_post'] here"),
    (dict(buffer_tokens=512), "buffer_tokens 256 there, 512 here"),
    (dict(train_batch_size_tokens=64), "train_batch_size_tokens 128 there, 64 here"),
])
def test_a_resume_into_a_different_run_names_the_difference(run, checkpoint, change, difference):
    model, tokens, _ = run
    arguments = {**RUN, "hook_name": HOOK, **change}
    with pytest.raises(CheckpointError, match="is a checkpoint of another run: .*" + difference.replace("[", r"\[")):
        train_sae(model, data=tokens, resume_from=checkpoint, **arguments)


def test_a_resume_on_other_data_is_refused(run, checkpoint):
    model, tokens, _ = run
    with pytest.raises(CheckpointError, match=r"data_shape \[16, 16\] there, \[8, 16\] here"):
        train_sae(model, HOOK, tokens[:8], resume_from=checkpoint, **RUN)


@pytest.mark.parametrize("edit, field", [
    (lambda s: s.update(step=10**9), r"field 'step' must be from 0 to this run's total_steps=4"),
    (lambda s: s.update(step="2"), r"field 'step' must be a int"),
    (lambda s: s.pop("optimizer"), r"field 'optimizer' is missing"),
    (lambda s: s["buffer"].update(storage=torch.zeros(100_000, 16)), r"field 'buffer.storage' holds 100000 rows"),
    (lambda s: s["buffer"].update(rows_consumed=-1), r"field 'buffer.rows_consumed' must be a whole number"),
    (lambda s: s["buffer"].update(generator=torch.zeros(3, dtype=torch.uint8)), r"'buffer.generator' is not"),
    (lambda s: s["tracker"].update(steps_since_fired=torch.zeros(17)), r"'tracker.steps_since_fired' must be a float tensor \[16\]"),
    (lambda s: s.update(scales=[[float("nan")], [1.0]]), r"field 'scales' must be two lists of 1 positive finite"),
    (lambda s: s["sae"].update(W_enc=torch.zeros(16, 17)), r"field 'sae' holds other parameters .*W_enc"),
    (lambda s: s["optimizer"]["state"][0].update(exp_avg=torch.zeros(3)), r"field 'optimizer.state\[0\].exp_avg' has shape \[3\]"),
    (lambda s: s["run"].update(architecture="standard"), r"architecture 'standard' there, 'topk' here"),
])
def test_a_tampered_checkpoint_is_refused_naming_the_field(run, checkpoint, edit, field):
    model, tokens, _ = run
    tamper(checkpoint, edit)
    with pytest.raises(CheckpointError, match=field):
        train_sae(model, HOOK, tokens, resume_from=checkpoint, **RUN)


def test_a_checkpoint_holding_code_is_not_unpickled(run, checkpoint):
    model, tokens, _ = run
    torch.save({"step": 2, "payload": Path("x")}, checkpoint / checkpoints.STATE_FILE)
    with pytest.raises(CheckpointError, match="is not a readable training state"):
        train_sae(model, HOOK, tokens, resume_from=checkpoint, **RUN)


def test_a_checkpoint_linked_from_outside_its_folder_is_refused(run, checkpoint, tmp_path):
    model, tokens, _ = run
    outside = tmp_path / "elsewhere.pt"
    (checkpoint / checkpoints.STATE_FILE).rename(outside)
    (checkpoint / checkpoints.STATE_FILE).symlink_to(outside)
    with pytest.raises(CheckpointError, match="resolves outside the checkpoint folder"):
        train_sae(model, HOOK, tokens, resume_from=checkpoint, **RUN)


def test_a_failed_checkpoint_save_leaves_the_previous_one_loadable(run, checkpoint, monkeypatch):
    model, tokens, _ = run
    before = (checkpoint / checkpoints.STATE_FILE).read_bytes()

    def failing_save(state, path):
        Path(path).write_bytes(b"half")
        raise OSError("disk full")
    monkeypatch.setattr(checkpoints.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        train_sae(model, HOOK, tokens, checkpoint_dir=checkpoint.parent, **{**RUN, "checkpoint_every": 2})
    assert (checkpoint / checkpoints.STATE_FILE).read_bytes() == before
    assert sorted(p.name for p in checkpoint.iterdir()) == ["step.json", checkpoints.STATE_FILE]
    monkeypatch.undo()
    assert train_sae(model, HOOK, tokens, resume_from=checkpoint, **RUN).cfg.d_sae == 16


@pytest.mark.parametrize("change, named", [
    (dict(outlier_norm_ratio=0.0), "outlier_norm_ratio must be a finite number of at least 1"),
    (dict(outlier_norm_ratio=float("nan")), "outlier_norm_ratio must be a finite number of at least 1"),
    (dict(outlier_norm_ratio=-3), "outlier_norm_ratio"),
    (dict(outlier_norm_ratio="10"), "outlier_norm_ratio"),
    (dict(buffer_tokens=float("nan")), "buffer_tokens must be a whole number of at least 1, got nan"),
    (dict(buffer_tokens=300.5), "buffer_tokens must be a whole number"),
    (dict(train_batch_size_tokens=0), "train_batch_size_tokens must be a whole number of at least 1"),
    (dict(store_batch_size_prompts=0.5), "store_batch_size_prompts must be a whole number"),
    (dict(lr=float("nan")), "lr must be a positive finite number"),
])
def test_settings_that_cannot_progress_are_refused_before_anything_runs(change, named):
    model = _model()
    arguments = {**RUN, "checkpoint_every": 0, **change}
    with pytest.raises(InputError, match=named):
        train_sae(model, HOOK, torch.randint(1, 64, (4, 8)), **arguments)
    assert not any(point._forward_hooks for point in model.hook_dict.values())


def test_data_of_special_tokens_only_is_refused_before_anything_runs():
    model = _model()
    model.tokenizer = type("Tokenizer", (), {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": None})()
    with pytest.raises(InputError, match=r"data holds only special tokens \[0\]"):
        train_sae(model, HOOK, torch.zeros(4, 8, dtype=torch.long), **{**RUN, "checkpoint_every": 0})


@pytest.fixture
def cache(run, tmp_path):
    model, tokens, _ = run
    directory = tmp_path / "cache"
    model.run_with_cache(tokens, cache_dir=directory, names_filter=HOOK, batch_size=8)
    return directory


def test_a_cache_is_read_through_the_checked_reader(run, cache, monkeypatch):
    import experiments.sae.activations as activations
    opened = []
    real = activations.load_cache
    monkeypatch.setattr(activations, "load_cache", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    model, tokens, _ = run
    train_sae(model, HOOK, tokens, activation_cache=[cache], **{**RUN, "checkpoint_every": 0})
    assert opened == [cache]


def test_a_tampered_cache_index_is_refused_before_reading(run, cache):
    model, tokens, _ = run
    index = json.loads((cache / INDEX_NAME).read_text())
    index["shapes"][HOOK] = [16, 16, 10**9]
    (cache / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(InputError, match="activation_cache: .*shapes"):
        train_sae(model, HOOK, tokens, activation_cache=[cache], **{**RUN, "checkpoint_every": 0})


def test_a_cache_of_a_model_of_other_sizes_is_refused(run, cache):
    _, tokens, _ = run
    with pytest.raises(InputError, match="activation_cache: .*written by a model of other sizes"):
        train_sae(_model(d_model=32), HOOK, tokens, activation_cache=[cache], **{**RUN, "checkpoint_every": 0})


def test_a_cache_shard_linked_from_outside_is_refused(run, cache, tmp_path):
    model, tokens, _ = run
    shard = sorted(cache.glob("shard-*.safetensors"))[0]
    outside = tmp_path / "outside.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(CheckpointError, match="resolves outside the activation cache"):
        train_sae(model, HOOK, tokens, activation_cache=[cache], **{**RUN, "checkpoint_every": 0})


def test_a_cache_of_other_positions_is_refused(run, cache):
    model, tokens, _ = run
    with pytest.raises(InputError, match=r"training needs \[rows, pos=8, width\]"):
        train_sae(model, HOOK, tokens[:, :8], activation_cache=[cache], **{**RUN, "checkpoint_every": 0})
