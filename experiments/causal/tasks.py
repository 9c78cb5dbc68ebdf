"""Interchange tasks: base/source prompt pairs and what a known causal model predicts for each pair.

Legend: B batch, P position.

An ``InterchangeTask`` is the input ``transformer_lens.tools.analysis.interchange`` needs, packed so
that per-pair answers survive its batching: ``targets[i]`` is the answer class (a column of
``answers[i]``) the high-level causal model predicts for base ``i`` with the aligned variable taken
from source ``i``. Two tasks with known causal models:

- ``induction_task`` (the zoo's toy-attn-2l): ``BOS r1..rL r1..rk`` predicts ``r(k+1)``; the
  variable is the token after the first ``rk`` (one of two answer tokens), read where it sits.
- ``ioi_name_position_task`` (IOI, e.g. on SmolLM2): the variable is which name slot holds the
  indirect object (ABBA: the first, BABA: the second); with the source's slot the model should name
  the base's other person.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from jaxtyping import Int
from torch import Tensor

from workbench.errors import InputError


@dataclass(frozen=True)
class InterchangeTask:
    """Base/source pairs, the positions the variable sits at, and the high-level model's targets.

    ``answers[i]`` are the C token ids whose logits at ``read_positions[i]`` are the task logits;
    ``keys`` identify each source (the arbitrary-label control draws one label per key).

    Example:
        >>> task = induction_task(model, 8, seed=0)
        >>> task.base.shape, task.answers.shape, task.targets.tolist()[:4], task.n_classes
        (torch.Size([8, 17]), torch.Size([8, 2]), [1, 0, 1, 0], 2)
    """

    base: Int[Tensor, "B P"]
    source: Int[Tensor, "B P"]
    base_positions: Int[Tensor, "B"]  # where the variable is intervened on in each base
    source_positions: Int[Tensor, "B"]  # where it is read in each source
    read_positions: Int[Tensor, "B"]  # where each base's answer logits are read
    answers: Int[Tensor, "B n_classes"]
    targets: Int[Tensor, "B"]
    keys: tuple[str, ...]

    def __post_init__(self) -> None:
        n, width = self.base.shape if self.base.ndim == 2 else (-1, -1)
        if n < 1 or self.source.ndim != 2 or self.source.shape[0] != n:
            raise InputError(f"base and source must be [N, P] token tensors with the same N >= 1; got "
                             f"{tuple(self.base.shape)} and {tuple(self.source.shape)}")
        for name, width_of in (("base_positions", width), ("source_positions", self.source.shape[1]),
                               ("read_positions", width)):
            value = getattr(self, name)
            if value.shape != (n,) or not bool(((value >= 0) & (value < width_of)).all()):
                raise InputError(f"{name} must hold one position in 0..{width_of - 1} per pair ({n}); got "
                                 f"{value.tolist()}")
        if self.answers.ndim != 2 or self.answers.shape[0] != n or self.answers.shape[1] < 2:
            raise InputError(f"answers must be [N={n}, C>=2] token ids; got shape {tuple(self.answers.shape)}")
        if self.targets.shape != (n,) or not bool(((self.targets >= 0) & (self.targets < self.n_classes)).all()):
            raise InputError(f"targets must hold one class in 0..{self.n_classes - 1} per pair; got "
                             f"{self.targets.tolist()}")
        if len(self.keys) != n:
            raise InputError(f"keys must name each of the {n} sources; got {len(self.keys)}")

    def __len__(self) -> int:
        return self.base.shape[0]

    @property
    def n_classes(self) -> int:
        return self.answers.shape[1]


def induction_task(model, n: int, seed: int = 0, length: int = 10, copy_at: int = 6,
                   answer_ids: Optional[Sequence[int]] = None) -> InterchangeTask:
    """``n`` induction pairs: ``BOS r1..rL r1..rk`` -> ``r(k+1)``, where ``r(k+1)`` is one of two answers.

    Base and source draw every other token independently and hold different answers, so the
    target (the source's answer) is never the base's own. The variable sits at position ``k + 1``
    (``copy_at + 1``) of both; answers are read at the last position.

    Example:
        >>> task = induction_task(model, 4, seed=1)
        >>> int(task.base[0, task.base_positions[0]]) in task.answers[0].tolist()
        True
    """
    if n < 1 or not 1 <= copy_at < length:
        raise InputError(f"induction_task needs n >= 1 and 1 <= copy_at < length; got n={n}, "
                         f"copy_at={copy_at}, length={length}")
    vocab = model.cfg.d_vocab
    answers = torch.tensor(list(answer_ids) if answer_ids is not None else [vocab // 4, vocab // 4 + 1])
    if answers.shape != (2,) or not bool(((answers >= 0) & (answers < vocab)).all()):
        raise InputError(f"answer_ids must be two token ids in 0..{vocab - 1}; got {answers.tolist()}")
    generator = torch.Generator().manual_seed(seed)
    bos = torch.full((n, 1), int(model.to_tokens("")[0, 0]))

    def prompts(values: Tensor) -> Tensor:
        # random tokens from the upper vocabulary, away from the answers and special ids
        body = torch.randint(vocab // 2, vocab, (n, length), generator=generator)
        body[:, copy_at] = values
        return torch.cat([bos, body, body[:, :copy_at]], dim=1)

    base_class = torch.arange(n) % 2
    base, source = prompts(answers[base_class]), prompts(answers[1 - base_class])
    at = torch.full((n,), copy_at + 1)
    return InterchangeTask(base=base, source=source, base_positions=at, source_positions=at,
                           read_positions=torch.full((n,), base.shape[1] - 1), answers=answers.repeat(n, 1),
                           targets=1 - base_class, keys=tuple(str(row.tolist()) for row in source))


def ioi_name_position_task(data, hook_positions: str = "answer") -> InterchangeTask:
    """Pairs of IOI prompts from ``data`` (an ``experiments.datasets.IOIDataset``, right-padded).

    Base i is paired with source i + 1 for even i and i + 2 for odd i (cyclically), so with
    ``data``'s alternating orders about half the pairs share the base's slot and half do not. The variable is the indirect object's name slot
    (the order, ABBA or BABA): with the source's slot, the high-level model names the base's person
    in that slot, its IO if the orders agree and its subject if they differ. Answers are the base's
    [IO, S] ids, read (and intervened on) at each prompt's last real token.

    Example:
        >>> from experiments.datasets import ioi_dataset
        >>> data = ioi_dataset(model, 4, names=["man", "one", "two", "time", "they"])
        >>> task = ioi_name_position_task(data)
        >>> data.orders, task.targets.tolist()
        (['ABBA', 'BABA', 'ABBA', 'BABA'], [1, 0, 1, 0])
    """
    n = len(data)
    if n < 2:
        raise InputError(f"ioi_name_position_task needs at least 2 prompts to pair; got {n}")
    if hook_positions != "answer":
        raise InputError(f"hook_positions must be 'answer' (the last real token); got {hook_positions!r}")
    order = (torch.arange(n) + 1 + torch.arange(n) % 2) % n
    positions = data.answer_positions
    targets = torch.tensor([int(data.orders[i] != data.orders[int(j)]) for i, j in enumerate(order)])
    return InterchangeTask(base=data.clean_tokens, source=data.clean_tokens[order], base_positions=positions,
                           source_positions=positions[order], read_positions=positions,
                           answers=torch.stack([data.answer_tokens, data.wrong_tokens], dim=1), targets=targets,
                           keys=tuple(data.clean_prompts[int(j)] for j in order))
