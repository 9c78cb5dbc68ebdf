"""``experiments.distributed`` without starting Ray: argument errors, the missing-extra error, the
``--workers`` flags of the commands, ``IOIDataset.select``, and the per-prompt experiments run in this
process, whose means over prompts must be the dataset-level functions' results (``induction_scores``,
``induction_loss``, ``head_sweep``) on a small random model.
"""

import sys

import pandas as pd
import pytest
import torch

import workbench as wb
from experiments import distributed as dist
from experiments.ablation import head_sweep_per_prompt
from experiments.induction import induction_loss_per_prompt, induction_per_prompt
from experiments.ablation import head_sweep
from experiments.datasets import ioi_dataset, repeated_random_tokens
from experiments.distributed.shards import checked_rows
from experiments.induction import induction_loss, induction_scores
from tests.unit.helpers import make_model
from workbench.extras import MissingExtraError

TOKENS = torch.randint(0, 50, (6, 8), generator=torch.Generator().manual_seed(0))
TOY = "toy-attn-2l"


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


@pytest.mark.parametrize("kwargs, message", [
    ({"workers": 0}, "workers must be a whole number of at least 1, got 0"),
    ({"workers": 1.5}, "workers must be a whole number"),
    ({"workers": True}, "workers must be a whole number"),
    ({"shard_size": 0}, "shard_size must be a whole number of prompts >= 1"),
    ({"attention_mask": torch.ones(6, 7)}, r"attention_mask must have the tokens' shape \(6, 8\)"),
])
def test_bad_arguments_are_input_errors_raised_before_ray_starts(kwargs, message):
    with pytest.raises(wb.InputError, match=message):
        dist.run_sharded(head_sweep_per_prompt, TOKENS, TOY, **kwargs)
    assert not _ray_running()


@pytest.mark.parametrize("dataset, message", [
    (torch.zeros(0, 5, dtype=torch.long), "the dataset is empty"),
    ([], "the dataset is empty"),
    (torch.zeros(5, dtype=torch.long), r"must be ids \[batch, pos\], got shape \(5,\)"),
    ({"text": "a"}, "dataset must be an IOIDataset, token ids"),
])
def test_a_dataset_that_cannot_be_sharded_is_an_input_error(dataset, message):
    with pytest.raises(wb.InputError, match=message):
        dist.run_sharded(head_sweep_per_prompt, dataset, TOY)


def test_fn_must_be_callable():
    with pytest.raises(wb.InputError, match="fn must be a callable"):
        dist.run_sharded("head_sweep", TOKENS, TOY)


def test_unknown_model_is_a_checkpoint_error_naming_it_and_a_loaded_model_is_refused():
    with pytest.raises(wb.CheckpointError, match="no-such-model.*registered: .*toy-attn-2l"):
        dist.run_sharded(head_sweep_per_prompt, TOKENS, "no-such-model")
    with pytest.raises(wb.InputError, match="save one with model.save"):
        dist.run_sharded(head_sweep_per_prompt, TOKENS, make_model("mha_learned_ln"))
    assert not _ray_running()


def test_missing_ray_names_the_scale_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    with pytest.raises(MissingExtraError, match=r'sharded sweeps need the package .ray.*pip install -e "\.\[scale\]"'):
        dist.run_sharded(head_sweep_per_prompt, TOKENS, TOY)
    with pytest.raises(MissingExtraError, match=r"\[scale\]"):
        dist.WorkerPool(TOY, workers=1)


def test_mean_or_resample_ablation_over_shards_needs_a_fixed_reference():
    model = make_model("mha_learned_ln")
    with pytest.raises(wb.InputError, match="mean ablation over shards needs reference_tokens or reference_means"):
        head_sweep_per_prompt(model, TOKENS, method="mean")


def test_fn_rows_must_carry_a_prompt_column_numbered_within_the_shard():
    good = pd.DataFrame({"prompt": [0, 1, 1], "x": [1.0, 2.0, 3.0]})
    assert checked_rows(good, len, 2, 10, 12)["prompt"].tolist() == [10, 11, 11]
    with pytest.raises(wb.InputError, match="must return a DataFrame with a 'prompt' column"):
        checked_rows(pd.DataFrame({"x": [1]}), len, 0, 0, 1)
    with pytest.raises(wb.InputError, match="number them 0..1"):
        checked_rows(pd.DataFrame({"prompt": [0, 2]}), len, 0, 0, 2)


# ---- the commands' --workers / --ray-address ------------------------------------------------------
def test_a_command_without_per_prompt_work_refuses_workers_naming_itself(capsys, tmp_path):
    from experiments.cli import attention

    with pytest.raises(SystemExit) as exit_info:
        attention.main(["--model", TOY, "--workers", "2", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "python -m experiments.attention has no per-prompt work to share between Ray workers" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_workers_below_one_is_refused(capsys, tmp_path):
    from experiments.cli import ioi

    with pytest.raises(SystemExit):
        ioi.main(["--model", TOY, "--workers", "0", "--out", str(tmp_path)])
    assert "--workers must be at least 1, got 0" in capsys.readouterr().err


# ---- IOIDataset.select and the per-prompt experiments in one process ---------------------------------
def test_ioi_dataset_select_keeps_rows_and_width():
    model = wb.load_model(TOY)
    data = ioi_dataset(model, 6, names=["man", "one", "two", "time", "they"])
    part = data.select([4, 1])
    assert part.clean_prompts == [data.clean_prompts[4], data.clean_prompts[1]] and len(part) == 2
    assert torch.equal(part.clean_tokens, data.clean_tokens[[4, 1]]) and torch.equal(part.corrupt_mask, data.corrupt_mask[[4, 1]])
    assert torch.equal(part.answer_tokens, data.answer_tokens[[4, 1]]) and part.io_names == [data.io_names[4], data.io_names[1]]
    assert data.select(slice(2, 4)).templates == data.templates[2:4]
    with pytest.raises(wb.InputError, match=r"select needs row numbers in 0\.\.5"):
        data.select([6])


def test_induction_rows_average_to_the_dataset_functions():
    model, seq_len = make_model("mha_learned_ln"), 6
    tokens = repeated_random_tokens(model, seq_len, batch=4, seed=3)
    scores = dist.mean_over_prompts(induction_per_prompt(model, tokens, seq_len), ["layer", "head"])
    expected = induction_scores(model, seq_len, batch=4, seed=3)
    assert torch.allclose(torch.tensor(scores["score"].to_numpy()).view(2, 4), expected, atol=1e-6)
    loss = dist.mean_over_prompts(induction_loss_per_prompt(model, tokens, seq_len), ["position", "copy"])
    pd.testing.assert_frame_equal(loss, induction_loss(model, seq_len, batch=4, seed=3), check_exact=False, atol=1e-6)


def test_head_sweep_rows_are_head_sweep_per_prompt_and_average_to_it():
    model = make_model("gqa_rotary_rms_swiglu")
    mask = torch.ones_like(TOKENS)
    mask[1, 5:] = mask[4, 3:] = 0
    rows = head_sweep_per_prompt(model, TOKENS, attention_mask=mask)
    per_prompt = head_sweep(model, TOKENS, attention_mask=mask, per_prompt=True, progress=False)
    expected = per_prompt.sort_values(["prompt", "layer", "head"], ignore_index=True)
    pd.testing.assert_frame_equal(rows.drop(columns="clean"), expected[["prompt", "layer", "head", "metric", "delta"]])
    clean = torch.tensor(per_prompt.attrs["clean_metric_per_prompt"])[torch.tensor(rows["prompt"].to_numpy())]
    assert torch.allclose(torch.tensor(rows["clean"].to_numpy()), clean)
    means = dist.mean_over_prompts(rows.drop(columns="clean"), ["layer", "head"])
    pd.testing.assert_frame_equal(means, head_sweep(model, TOKENS, attention_mask=mask, progress=False),
                                  check_exact=False, atol=1e-6)
