"""Causal variables on the zoo's toy-attn-2l: DAS finds the planted variable, the controls do not.

toy-attn-2l was trained with an induction curriculum (workbench/zoo/recipes.py), so its known causal
model is induction: ``BOS r1..rL r1..rk`` -> ``r(k+1)``. The variable "the token after the first rk"
is planted at position k + 1; interchanging it from a source whose r(k+1) is the other answer must
flip the answer. Chance with two answers is 0.5; the controls are expected near or below it.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from experiments.causal import InterchangeTask, align_variable, induction_task, interchange_accuracy, reinitialized
from workbench.errors import InputError

HOOK = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return wb.load_model("toy-attn-2l", progress=False).eval()


@pytest.fixture(scope="module")
def report(model):
    return align_variable(model, induction_task(model, 64, seed=0), HOOK, rank=1, epochs=8)


def _no_hooks(model) -> bool:
    return not any(point.fwd_hooks or point.bwd_hooks for point in model.hook_dict.values())


def test_model_solves_the_task_without_intervention(model):
    task = induction_task(model, 16, seed=3)
    assert interchange_accuracy(model, task, HOOK, None, 1 - task.targets) == 1.0  # bases' own answers


def test_das_finds_the_planted_variable(report):
    assert report.accuracy("das") >= 0.95
    assert report.losses[-1] < report.losses[0] / 10


@pytest.mark.parametrize("control", ["arbitrary_labels", "random_init", "placebo", "random_basis",
                                     "no_intervention"])
def test_controls_stay_near_chance(report, control):
    assert report.accuracy(control) <= 0.7


def test_reinitialized_copy_is_untrained_and_leaves_the_model_alone(model):
    before = model.W_E.clone()
    fresh = reinitialized(model, seed=0)
    assert not fresh.training and fresh.cfg.d_model == model.cfg.d_model
    assert torch.equal(model.W_E, before) and not torch.equal(fresh.W_E, before)
    assert torch.equal(reinitialized(model, seed=0).W_E, fresh.W_E)  # seeded
    with pytest.raises(InputError, match="workbench Decoder"):
        reinitialized(torch.nn.Linear(2, 2), seed=0)


@pytest.mark.parametrize("hook, rank, controls, match", [
    ("blocks.9.hook_resid_post", 1, (), "no hook point named"),
    (HOOK, 0, (), "rank must be in 1..d_model"),
    (HOOK, 129, (), "rank must be in 1..d_model"),
    (HOOK, 1, ("bogus",), "unknown control"),
    ("blocks.0.attn.hook_pattern", 1, (), r"interchange needs a \[batch, pos, d_model"),
])
def test_bad_arguments_raise_clear_errors_and_leave_no_hook(model, hook, rank, controls, match):
    task = induction_task(model, 8, seed=1)
    with pytest.raises(InputError, match=match):
        align_variable(model, task, hook, rank=rank, epochs=1, controls=controls)
    assert _no_hooks(model)


def test_bad_tasks_raise_clear_errors(model):
    task = induction_task(model, 4)
    with pytest.raises(InputError, match="base_positions"):
        InterchangeTask(task.base, task.source, task.base_positions + 100, task.source_positions,
                        task.read_positions, task.answers, task.targets, task.keys)
    with pytest.raises(InputError, match="targets"):
        InterchangeTask(task.base, task.source, task.base_positions, task.source_positions,
                        task.read_positions, task.answers, task.targets + 5, task.keys)
    with pytest.raises(InputError, match="same N"):
        InterchangeTask(task.base, task.source[:2], task.base_positions, task.source_positions,
                        task.read_positions, task.answers, task.targets, task.keys)
    with pytest.raises(InputError, match="test_fraction"):
        align_variable(model, task, HOOK, epochs=1, test_fraction=0.0)
    with pytest.raises(InputError, match="copy_at"):
        induction_task(model, 4, copy_at=20)
    assert _no_hooks(model)
