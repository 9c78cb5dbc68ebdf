"""Distributed alignment search on our models, through TransformerLens 4.3's ``interchange``, with its controls.

Legend: B batch, P position, D d_model.

``align_variable`` trains a rank-``rank`` subspace at one hook point by DAS
(``transformer_lens.tools.analysis.fit_das``) so that interchanging it from source to base makes the
model give the high-level causal model's answer, then measures the interchange accuracy (the share
of held-out pairs where the model's answer is the target) for it and for the controls an
interchange accuracy must be read against (Arora et al., 2024):

- ``das``: the learned subspace;
- ``arbitrary_labels``: DAS trained the same way on ``arbitrary_targets`` (one pseudo-random label per
  source), scored against those labels: what the method's expressivity alone reaches;
- ``random_init``: DAS trained the same way on an untrained copy (``experiments.causal.reinitialized``);
- ``placebo``: the learned subspace's move, norm-matched, inside a random subspace of the same rank
  (``NormMatchedPlacebo``);
- ``random_basis``: a plain interchange on a random subspace of that rank;
- ``no_intervention``: the model's own answers.

A subspace carries the variable when ``das`` is high and every control is low.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
import transformer_lens.tools.analysis as tla
from jaxtyping import Float, Int
from torch import Tensor

from experiments.causal.controls import reinitialized
from experiments.causal.tasks import InterchangeTask
from workbench.errors import InputError


@dataclass(frozen=True)
class AlignmentReport:
    """The learned basis and the interchange accuracy of DAS and each control on the held-out pairs.

    Example:
        >>> from experiments.causal.tasks import induction_task
        >>> report = align_variable(model, induction_task(model, 24), "blocks.0.hook_resid_post", epochs=2,
        ...                         controls=("placebo",))
        >>> report.table.columns.tolist(), report.basis.shape
        (['subspace', 'interchange_accuracy'], torch.Size([128, 1]))
    """

    hook_name: str
    basis: Float[Tensor, "D rank"]
    table: pd.DataFrame  # subspace, interchange_accuracy
    losses: tuple[float, ...]

    def accuracy(self, subspace: str) -> float:
        return float(self.table.set_index("subspace").loc[subspace, "interchange_accuracy"])


CONTROLS = ("arbitrary_labels", "random_init", "placebo", "random_basis", "no_intervention")


def task_logits(model, task: InterchangeTask):
    """The ``TaskLogits`` callable ``interchange`` wants, over the packed rows ``packed_inputs`` makes.

    Each packed row carries its tokens, its read position and its answer ids, so the callable
    reads each pair's own answers whatever rows ``interchange`` batches together.

    Example:
        >>> from experiments.causal.tasks import induction_task
        >>> task = induction_task(model, 4)
        >>> task_logits(model, task)(packed_inputs(task, task.base)).shape
        torch.Size([4, 2])
    """
    width, n_classes = task.base.shape[1], task.n_classes

    def logits_of_answers(packed: Int[Tensor, "B packed"]) -> Float[Tensor, "B n_classes"]:
        tokens, read, answers = packed[:, :width], packed[:, width], packed[:, width + 1:]
        logits = model(tokens)
        rows = torch.arange(len(packed), device=logits.device)
        return logits[rows[:, None], read.to(logits.device)[:, None], answers.to(logits.device)]

    assert n_classes >= 2  # InterchangeTask checked it
    return logits_of_answers


def packed_inputs(task: InterchangeTask, tokens: Int[Tensor, "B P"]) -> Int[Tensor, "B packed"]:
    """``tokens`` with each pair's read position and answer ids appended as columns (see ``task_logits``).

    Example:
        >>> from experiments.causal.tasks import induction_task
        >>> task = induction_task(model, 2)
        >>> packed_inputs(task, task.base).shape  # 17 tokens, 1 read position, 2 answers
        torch.Size([2, 20])
    """
    return torch.cat([tokens, task.read_positions[:, None], task.answers], dim=1)


def interchange_accuracy(model, task: InterchangeTask, hook_name: str, intervention, targets: Tensor) -> float:
    """Share of pairs whose answer under ``intervention`` at ``hook_name`` is ``targets``' class.

    ``intervention`` is any ``interchange`` intervention (``SubspaceInterchange``, ``NormMatchedPlacebo``),
    or None for the model's own answers on the bases.

    Example:
        >>> from experiments.causal.tasks import induction_task
        >>> task = induction_task(model, 8)
        >>> interchange_accuracy(model, task, "blocks.0.hook_resid_post", None, 1 - task.targets)  # bases' own
        1.0
    """
    _check(model, task, hook_name)
    run = task_logits(model, task)
    if intervention is None:
        with torch.no_grad():
            logits = run(packed_inputs(task, task.base))
    else:
        source = tla.collect_activations(model, hook_name, packed_inputs(task, task.source), run,
                                         positions=task.source_positions)
        logits = tla.intervened_logits(model, hook_name, intervention, packed_inputs(task, task.base), source, run,
                                       positions=task.base_positions)
    return float((logits.argmax(-1).cpu() == targets.cpu()).float().mean())


def _fit(model, task: InterchangeTask, hook_name: str, targets: Tensor, rank: int, epochs: int, lr: float,
         seed: int) -> tla.interchange.DASResult:
    return tla.fit_das(model, hook_name, packed_inputs(task, task.base), packed_inputs(task, task.source), targets,
                       task_logits(model, task), rank=rank, base_positions=task.base_positions,
                       source_positions=task.source_positions, epochs=epochs, lr=lr, seed=seed,
                       batch_size=32)


def _check(model, task: InterchangeTask, hook_name: str, rank: int = 1) -> None:
    if not isinstance(task, InterchangeTask):
        raise InputError(f"task must be an experiments.causal.InterchangeTask; got {type(task).__name__}")
    if hook_name not in model.hook_dict:
        raise InputError(f"no hook point named {hook_name!r} in this model; model.hook_dict lists its "
                         f"{len(model.hook_dict)} hook points")
    if not 1 <= rank <= model.cfg.d_model:
        raise InputError(f"rank must be in 1..d_model ({model.cfg.d_model}); got {rank}")
    if int(task.answers.max()) >= model.cfg.d_vocab or int(task.base.max()) >= model.cfg.d_vocab:
        raise InputError(f"the task's token ids must be below the model's vocabulary size {model.cfg.d_vocab}")
    with torch.no_grad():  # one row, to name a hook whose activation is not the [batch, pos, d_model] stream
        _, cache = model.run_with_cache(task.base[:1], names_filter=hook_name)
    shape = tuple(cache[hook_name].shape)
    if len(shape) != 3 or shape[-1] != model.cfg.d_model:
        raise InputError(f"{hook_name}'s activation has shape {shape}; interchange needs a [batch, pos, d_model="
                         f"{model.cfg.d_model}] hook point such as blocks.0.hook_resid_post")


def _split(task: InterchangeTask, test_fraction: float) -> tuple[InterchangeTask, InterchangeTask]:
    n_test = max(1, round(len(task) * test_fraction))
    if not 0 < test_fraction < 1 or n_test >= len(task):
        raise InputError(f"test_fraction must leave pairs on both sides of the split; got {test_fraction} of "
                         f"{len(task)} pairs")

    def rows(index: slice) -> InterchangeTask:
        return InterchangeTask(task.base[index], task.source[index], task.base_positions[index],
                               task.source_positions[index], task.read_positions[index], task.answers[index],
                               task.targets[index], task.keys[index])

    return rows(slice(0, len(task) - n_test)), rows(slice(len(task) - n_test, len(task)))


def align_variable(model, task: InterchangeTask, hook_name: str, rank: int = 1, epochs: int = 10,
                   lr: float = 1e-2, test_fraction: float = 0.25, seed: int = 0,
                   controls: tuple[str, ...] = CONTROLS) -> AlignmentReport:
    """DAS at ``hook_name`` on the first pairs of ``task``, scored with ``controls`` on the held-out rest.

    Each DAS fit (the aligned one and the arbitrary-label and random-init controls) has the same
    pairs, rank, epochs and learning rate. Raises ``InputError`` for an unknown hook point, a rank
    outside 1..d_model, an unknown control, token ids outside the vocabulary or a split with an empty
    side; hooks are only ever attached inside ``interchange``'s context managers, so none is left.

    Example:
        >>> from experiments.causal.tasks import induction_task
        >>> report = align_variable(model, induction_task(model, 8, seed=0), "blocks.0.hook_resid_post", epochs=2)
        >>> report.table.subspace.tolist()   # the aligned subspace, then each control
        ['das', 'arbitrary_labels', 'random_init', 'placebo', 'random_basis', 'no_intervention']
    """
    _check(model, task, hook_name, rank)
    unknown = [name for name in controls if name not in CONTROLS]
    if unknown:
        raise InputError(f"unknown control(s) {unknown}; choose from {list(CONTROLS)}")
    train, test = _split(task, test_fraction)
    fitted = _fit(model, train, hook_name, train.targets, rank, epochs, lr, seed)
    rows = [("das", interchange_accuracy(model, test, hook_name, tla.SubspaceInterchange(fitted.basis),
                                         test.targets))]
    random_basis = tla.random_basis(model.cfg.d_model, rank, seed=seed + 1)
    for name in controls:
        if name == "arbitrary_labels":
            labels = tla.arbitrary_targets(task.keys, task.n_classes, seed=seed)
            arbitrary = _fit(model, train, hook_name, labels[:len(train)], rank, epochs, lr, seed)
            score = interchange_accuracy(model, test, hook_name, tla.SubspaceInterchange(arbitrary.basis),
                                         labels[len(train):])
        elif name == "random_init":
            fresh = reinitialized(model, seed)
            untrained = _fit(fresh, train, hook_name, train.targets, rank, epochs, lr, seed)
            score = interchange_accuracy(fresh, test, hook_name, tla.SubspaceInterchange(untrained.basis),
                                         test.targets)
        elif name == "placebo":
            placebo = tla.NormMatchedPlacebo(tla.SubspaceInterchange(fitted.basis), random_basis)
            score = interchange_accuracy(model, test, hook_name, placebo, test.targets)
        elif name == "random_basis":
            score = interchange_accuracy(model, test, hook_name, tla.SubspaceInterchange(random_basis), test.targets)
        else:
            score = interchange_accuracy(model, test, hook_name, None, test.targets)
        rows.append((name, score))
    table = pd.DataFrame(rows, columns=["subspace", "interchange_accuracy"])
    return AlignmentReport(hook_name=hook_name, basis=fitted.basis.cpu(), table=table, losses=fitted.losses)
