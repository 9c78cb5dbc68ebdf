"""Sharded sweeps on a local Ray cluster (``experiments.distributed``) equal the one-process results.

Expected values come from the existing functions run once in this process on the whole dataset:
``patch_heads`` / ``head_sweep`` (``per_prompt=True``), ``ioi_logit_diffs``, ``ioi_patching``
(already tested against TransformerLens), or the ready-made per-prompt function itself. Sharded
results differ from them by float noise only (shards run at their own width and batch size):
SmolLM2-135M values agree within 1e-4, the toy models' within 1e-5. SmolLM2 runs 2 prompts (its
270-head sweeps cost ~4 s per prompt on 2 cores); the 24-prompt sweeps, the worker-crash cases and
the commands use the toy models. One 2-CPU cluster serves the module; ``address=`` is tested from a
second process (a command given ``--ray-address``), which must leave the cluster running.
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import workbench as wb
from experiments import distributed as dist
from experiments.ablation import head_sweep_per_prompt
from experiments.ioi import ioi_per_prompt, ioi_result
from experiments.ablation import head_sweep
from experiments.datasets import ioi_dataset
from experiments.ioi import ioi_logit_diffs, ioi_patching
from experiments.patching import patch_heads

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TOY = "toy-attn-2l"
TOY_NAMES = ["man", "one", "two", "time", "they"]  # single tokens after a space in the toy tokenizer


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs for the whole module; yields its address."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def toy():
    return wb.load_model(TOY).eval()


@pytest.fixture(scope="module")
def toy_data(toy):
    data = ioi_dataset(toy, 24, seed=0, names=TOY_NAMES)
    assert len(set(data.clean_mask.sum(1).tolist())) > 1  # padded: shards trim to their own widths
    return data


def _prompt_major(table: pd.DataFrame) -> pd.DataFrame:
    return table.sort_values(["prompt", "layer", "head"], ignore_index=True)


def _assert_close(sharded: pd.DataFrame, expected: pd.DataFrame, columns, atol: float) -> None:
    for column in columns:
        np.testing.assert_allclose(sharded[column].to_numpy(), expected[column].to_numpy(), rtol=0, atol=atol,
                                   err_msg=column)


# ---- SmolLM2-135M: IOI patching and a head sweep, on one pool of two workers ------------------------
def test_ioi_patching_and_head_sweep_on_two_workers_equal_one_process(cluster, smollm2):
    data = ioi_dataset(smollm2, 2, seed=0)
    texts = ["The cat sat on the mat.", "Mary gave John a drink"]  # texts of two lengths: each shard pads its own
    with dist.WorkerPool("smollm2-135m", workers=2) as pool:
        rows = pool.run(ioi_per_prompt, data, shard_size=1, progress=False)
        sweep = pool.run(head_sweep_per_prompt, texts, shard_size=1, progress=False)
    assert rows.attrs["sharding"]["shards"] == 2 and rows.attrs["sharding"]["reruns"] == 0
    with torch.no_grad():
        heads = _prompt_major(patch_heads(smollm2, data.clean_tokens, data.corrupt_tokens, data.answer_tokens,
                                          data.wrong_tokens, False, per_prompt=True, clean_mask=data.clean_mask,
                                          corrupt_mask=data.corrupt_mask))
        diffs = ioi_logit_diffs(smollm2, data)
        expected = head_sweep(smollm2, texts, "loss", progress=False, per_prompt=True)
    n_heads = smollm2.cfg.n_layers * smollm2.cfg.n_heads
    assert len(rows) == 2 * n_heads and rows["prompt"].tolist() == np.repeat(np.arange(2), n_heads).tolist()
    assert rows[["layer", "head"]].equals(heads[["layer", "head"]])
    _assert_close(rows, heads, ["metric", "delta"], atol=1e-4)
    _assert_close(rows.drop_duplicates("prompt").reset_index(drop=True), diffs, ["clean", "corrupt"], atol=1e-4)
    assert ((diffs.clean - diffs.corrupt).abs() > 0.5).all()  # normalized = delta / that gap is well defined
    _assert_close(rows, heads, ["normalized"], atol=1e-3)

    clean = np.asarray(expected.attrs["clean_metric_per_prompt"])
    expected = _prompt_major(expected)
    assert sweep[["prompt", "layer", "head"]].equals(expected[["prompt", "layer", "head"]])
    _assert_close(sweep, expected, ["metric", "delta"], atol=1e-4)
    np.testing.assert_allclose(sweep["clean"], clean[sweep["prompt"]], rtol=0, atol=1e-4)


# ---- toy model: identity with the one-process function, crashes, errors -------------------------
def always_dies(model, shard):
    """A fn whose worker process exits on every attempt (imported by the workers from this module)."""
    os._exit(1)


def rejects_shard(model, shard):
    raise wb.InputError("this shard is unusable")


class TestOnePoolOfToyWorkers:
    """Two workers holding the toy model, shared by these tests (a pool starts in seconds, not instantly)."""

    @pytest.fixture(scope="class")
    def pool(self, cluster):
        with dist.WorkerPool(TOY, workers=2) as pool:
            yield pool

    def test_sharded_result_is_the_function_on_the_whole_dataset(self, pool, toy, toy_data):
        rows = pool.run(ioi_per_prompt, toy_data, shard_size=5, progress=False)
        whole = ioi_per_prompt(toy, toy_data)
        assert list(rows.columns) == list(whole.columns) and rows.dtypes.equals(whole.dtypes)
        assert rows[["prompt", "layer", "head"]].equals(whole[["prompt", "layer", "head"]])
        _assert_close(rows, whole, ["clean", "corrupt", "metric", "delta"], atol=1e-5)
        result, expected = ioi_result(rows), ioi_patching(toy, toy_data, progress=False)
        pd.testing.assert_frame_equal(result.head_patching, expected.head_patching, check_exact=False, rtol=0,
                                      atol=1e-5)
        pd.testing.assert_frame_equal(result.logit_diff, expected.logit_diff, check_exact=False, rtol=0, atol=1e-5)

    def test_token_ids_with_a_mask_shard_with_their_mask(self, pool, toy, toy_data):
        tokens, mask = toy_data.clean_tokens, toy_data.clean_mask
        rows = pool.run(head_sweep_per_prompt, tokens, attention_mask=mask, shard_size=7, progress=False)
        whole = head_sweep_per_prompt(toy, tokens, attention_mask=mask)
        assert rows.dtypes.equals(whole.dtypes)
        assert rows[["prompt", "layer", "head"]].equals(whole[["prompt", "layer", "head"]])
        _assert_close(rows, whole, ["clean", "metric", "delta"], atol=1e-5)
        means = head_sweep(toy, tokens, attention_mask=mask, progress=False)  # the dataset-level table
        pd.testing.assert_frame_equal(dist.mean_over_prompts(rows.drop(columns="clean"), ["layer", "head"]), means,
                                      check_exact=False, rtol=0, atol=1e-5)

    def test_a_worker_that_dies_has_its_shard_rerun_and_nothing_is_lost_or_doubled(self, pool, toy, toy_data):
        counted = []
        rows = pool.run(ioi_per_prompt, toy_data, shard_size=4, _die_on_first_attempt={0, 3},
                        progress=lambda done, total: counted.append((done, total)))
        assert rows.attrs["sharding"]["reruns"] == 2  # shards 0 and 3 ran twice, on fresh workers
        whole = ioi_per_prompt(toy, toy_data)
        assert rows[["prompt", "layer", "head"]].equals(whole[["prompt", "layer", "head"]])  # each row once
        assert not rows.duplicated(["prompt", "layer", "head"]).any()
        _assert_close(rows, whole, ["clean", "corrupt", "metric", "delta"], atol=1e-5)
        assert counted[-1] == (24, 24) and len(counted) == 6  # progress counts each shard once

    def test_an_error_in_fn_reaches_the_driver_as_itself_naming_the_shard(self, pool, toy_data):
        with pytest.raises(wb.InputError, match="this shard is unusable") as caught:
            pool.run(rejects_shard, toy_data, shard_size=12, progress=False)
        assert any("on shard" in note and "rejects_shard" in note for note in caught.value.__notes__)


def test_a_shard_that_keeps_killing_its_worker_is_named_after_bounded_retries(cluster, toy_data):
    with pytest.raises(dist.ShardFailedError, match=r"shard 0 \(prompts 0\.\.23\) failed on 2 workers"):
        dist.run_sharded(always_dies, toy_data, TOY, workers=1, shard_size=24, max_retries=1, progress=False)


# ---- commands: --workers 2 writes what --workers 1 writes ------------------------------------------
COMMANDS = {
    "ioi": ["--n", "12", "--names", *TOY_NAMES, "--top-k", "3"],
    "induction": ["--seq-len", "20", "--batch", "6"],
    "ablation": ["--prompt", "the man was one of them", "--prompt", "two time they", "--prompt", "it is for the man"],
}


def _csvs(directory: Path) -> dict[str, pd.DataFrame]:
    return {path.name: pd.read_csv(path) for path in sorted(directory.glob("*.csv"))}


def _assert_same_outputs(one: Path, two: Path) -> None:
    expected, got = _csvs(one), _csvs(two)
    assert expected and list(got) == list(expected)
    for name, table in expected.items():
        pd.testing.assert_frame_equal(got[name], table, check_exact=False, rtol=0, atol=1e-5, obj=name)
    for path in one.glob("*.json"):
        assert json.loads((two / path.name).read_text()).keys() == json.loads(path.read_text()).keys()


@pytest.mark.parametrize("command", ["ioi", "induction"])
def test_command_on_two_workers_writes_what_one_process_writes(cluster, command, tmp_path):
    import importlib

    main = importlib.import_module(f"experiments.cli.{command}").main
    args = ["--model", TOY, "--no-progress", *COMMANDS[command]]
    with torch.no_grad():
        main(args + ["--out", str(tmp_path / "one")])
        main(args + ["--workers", "2", "--out", str(tmp_path / "two")])
    _assert_same_outputs(tmp_path / "one", tmp_path / "two")


def test_command_connects_to_an_existing_cluster_by_address_and_leaves_it_running(cluster, tmp_path):
    import ray

    from experiments.cli import ablation

    args = ["--model", TOY, "--no-progress", *COMMANDS["ablation"]]
    with torch.no_grad():
        ablation.main(args + ["--out", str(tmp_path / "one")])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "experiments.ablation", *args, "--ray-address", cluster,
                           "--workers", "2", "--out", str(tmp_path / "two")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same_outputs(tmp_path / "one", tmp_path / "two")
    assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 2  # still up after the other driver left
