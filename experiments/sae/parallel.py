"""Data-parallel SAE training over ``torch.distributed`` (launched by ``torchrun`` or ``accelerate launch``; gloo
on CPU, NCCL on GPUs): ``train_sae`` / ``train_saes`` / ``train_clt`` run unchanged in every process of an
initialised process group (``init_process_group`` first, or ``world_from_environment``).

Legend: N flattened tokens, i d_in, X d_sae.

(``i`` below is a buffered row's width; a process's share of a batch is ``N`` rows too.)

Every process reads the same stream (the model's forward or the disk cache, one buffer of ``buffer_tokens`` rows,
the same shuffling generator), so the batches are the one-process batches and memory per process is bounded by
the buffer as in one process. Each process then trains on its share of every batch (rows ``rank::world_size``):
its loss is weighted by its share of the rows, the gradients are summed over processes (so they are the whole
batch's), and every process takes the same clipped Adam step, so the modules stay equal. Dead-feature counters
see a feature fire anywhere in the batch; the log rows are computed on the whole batch. Only rank 0 writes
(checkpoints, ``out``); every process resumes from the same checkpoint. The result equals one process's within
float tolerance (sums are taken in another order). A training form whose activation couples the rows of a batch
(batch-top-k's ``k * N`` largest of the batch) is refused (``couples_rows``).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from jaxtyping import Float
from torch import Tensor

from workbench.errors import InputError


@dataclass(frozen=True)
class World:
    """This process's rank among ``size`` training processes (``World()``: one process, nothing shared).

    Example:
        >>> World().rows(torch.arange(6)[:, None]).flatten().tolist(), World(1, 2).rows(torch.arange(6)[:, None]).flatten().tolist()
        ([0, 1, 2, 3, 4, 5], [1, 3, 5])
    """

    rank: int = 0
    size: int = 1

    @property
    def writes(self) -> bool:
        """Whether this process writes checkpoints and results (rank 0)."""
        return self.rank == 0

    def rows(self, rows: Float[Tensor, "N i"]) -> Float[Tensor, "N i"]:
        """This process's share of a batch: rows ``rank::size``."""
        return rows if self.size == 1 else rows[self.rank::self.size]

    def share(self, n_rows: int) -> float:
        """The weight of this process's mean loss: its rows over the batch's."""
        return len(range(self.rank, n_rows, self.size)) / n_rows

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Every parameter's gradient summed over the processes (one flattened all-reduce)."""
        if self.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        start = 0
        for p, g in zip(parameters, grads):
            p.grad = flat[start:start + g.numel()].view_as(g).clone()
            start += g.numel()

    def fired(self, feature_acts: Float[Tensor, "N X"]) -> Float[Tensor, "N X"]:
        """Which features fired on any process's rows (with one process, ``feature_acts`` itself; else a one-row
        stand-in for the batch's activations)."""
        if self.size == 1:
            return feature_acts
        fired = (feature_acts > 0).any(0, keepdim=True).float()
        if self.size > 1:
            dist.all_reduce(fired, op=dist.ReduceOp.MAX)
        return fired

    def gather(self, rows: Float[Tensor, "N i"]) -> Float[Tensor, "N i"]:
        """Every process's rows, in rank order (all of a batch, for its log row)."""
        if self.size == 1:
            return rows
        sizes = [torch.zeros((), dtype=torch.long) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor(len(rows)))
        padded = torch.zeros((int(max(sizes)), *rows.shape[1:]), dtype=rows.dtype)
        padded[:len(rows)] = rows.detach()
        parts = [torch.zeros_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        return torch.cat([part[:int(n)] for part, n in zip(parts, sizes)])

    def total(self, value: Tensor) -> float:
        """A number summed over the processes."""
        value = value.detach().double().reshape(1).clone()
        if self.size > 1:
            dist.all_reduce(value)
        return float(value)

    def barrier(self) -> None:
        """Waits for every process (after rank 0 wrote)."""
        if self.size > 1:
            dist.barrier()


def current_world() -> World:
    """The initialised process group's ``World`` (one process when none is).

    Example:
        >>> current_world()
        World(rank=0, size=1)
    """
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def world_from_environment(backend: str = "gloo") -> World:
    """Initialises the process group from the variables ``torchrun`` / ``accelerate launch`` set (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; ``backend``: ``gloo`` on CPU, ``nccl`` on GPUs) unless one
    is; an ``InputError`` naming what is missing otherwise. A group started here is destroyed when the process
    exits: left to the interpreter's shutdown, gloo's threads can abort the process (SIGABRT, "terminate called
    without an active exception") after its work is done, failing the launcher.

    Example:
        >>> world_from_environment() if "RANK" in os.environ else World()
        World(rank=0, size=1)
    """
    if dist.is_initialized():
        return current_world()
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise InputError(f"world_from_environment needs {missing} set (launch with torchrun or accelerate launch)")
    dist.init_process_group(backend)
    atexit.register(_destroy_process_group)
    return current_world()


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def check_parallel_forms(world: World, modules: Iterable[torch.nn.Module]) -> None:
    """Refuses, with more than one process, a training form whose activation couples a batch's rows.

    Example:
        >>> from types import SimpleNamespace
        >>> batch_top_k = SimpleNamespace(form=SimpleNamespace(name="batchtopk", couples_rows=True))
        >>> check_parallel_forms(World(), [batch_top_k])   # one process: nothing to refuse
        >>> check_parallel_forms(World(0, 2), [batch_top_k])
        Traceback (most recent call last):
        workbench.errors.InputError: 'batchtopk' chooses its active features over the whole batch; it cannot be trained data-parallel over 2 processes (train it in one process)
    """
    if world.size == 1:
        return
    for module in modules:
        if getattr(module.form, "couples_rows", False):
            raise InputError(f"{module.form.name!r} chooses its active features over the whole batch; it cannot be "
                             f"trained data-parallel over {world.size} processes (train it in one process)")
