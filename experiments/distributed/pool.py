"""Ray workers that each hold one loaded model and run shard after shard: ``WorkerPool``, and ``run_sharded``
(one pool for one sweep). Faults, padding and the Ray lifecycle: ``experiments.distributed``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Collection, Optional, Union

import pandas as pd
import torch
from torch import Tensor

import workbench as wb
from experiments._progress import Progress, ProgressArg
from experiments.datasets import IOIDataset
from experiments.distributed.shards import MAX_SHARD, Dataset, checked_rows, checked_sweep, merged_attrs, shard_payload
from workbench.errors import InputError
from workbench.extras import require
from workbench.loading import model_config


class ShardFailedError(RuntimeError):
    """A shard's worker died on every attempt; the message names the shard, its prompts and the last error."""


# ---- the worker ---------------------------------------------------------------------------------
class _ShardWorker:
    """The body of one Ray actor (wrapped by ``ray.remote`` at run time, so importing this module needs no Ray)."""

    def __init__(self, source: str, load_kwargs: dict, device: str, threads: int):
        torch.set_num_threads(threads)
        self.source, self.load_kwargs, self.device, self.model = source, load_kwargs, device, None

    def load(self) -> float:
        """Loads the model; returns the seconds it took."""
        start = time.perf_counter()
        self.model = wb.load_model(self.source, device=self.device, **self.load_kwargs).eval()
        return time.perf_counter() - start

    def run(self, fn: Callable, shard: int, attempt: int, die_on_first_attempt: Collection[int],
            payload: tuple, fn_kwargs: dict) -> pd.DataFrame:
        if attempt == 0 and shard in die_on_first_attempt:
            os._exit(1)  # test hook: the worker process dies as a crash would
        args, kwargs = payload
        args = [_to_device(value, self.device) for value in args]
        kwargs = {key: _to_device(value, self.device) for key, value in kwargs.items()}
        return fn(self.model, *args, **kwargs, **fn_kwargs)


def _to_device(value: Any, device: str) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, IOIDataset):
        return dataclasses.replace(value, **{f.name: getattr(value, f.name).to(device) for f in dataclasses.fields(value)
                                             if isinstance(getattr(value, f.name), Tensor)})
    return value


def _checked_source(model: Any, remote: bool) -> str:
    """``model`` as a source every worker can load: a registered name (installed, for a local Ray) or a path."""
    if isinstance(model, torch.nn.Module):
        raise InputError("model must be a registered name or a path that each worker loads itself, not a loaded model; "
                         "save one with model.save(directory) and pass the directory")
    if not isinstance(model, (str, Path)) or not str(model):
        raise InputError(f"model must be a registered name (wb.list_models()) or a path, got {model!r}")
    if not remote:  # the CheckpointError load_model would give: unknown name, not installed, missing path, bad config
        model_config(model)
    return str(model)


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])


class WorkerPool:
    """Ray workers that each hold one loaded model, for one or more sharded sweeps.

    ``workers`` actors load ``model`` once each (``load_kwargs`` go to ``wb.load_model``, e.g.
    ``{"attn_impl": "sdpa"}``); ``num_gpus`` per worker puts its model on "cuda". ``cpus_per_worker``
    (default: the machine's cores, or the cluster's CPUs, over ``workers``) is both the Ray
    reservation and the worker's torch threads. ``max_retries``: reruns of a shard whose worker dies.
    ``load_s`` holds each worker's load time in seconds. Use it as a context manager, or ``close()``.

    Example:
        >>> from experiments.ablation import head_sweep_per_prompt
        >>> from experiments.induction import induction_per_prompt, repeated_random_tokens
        >>> with WorkerPool("toy-attn-2l", workers=2) as pool:                     # doctest: +SKIP
        ...     sweep = pool.run(head_sweep_per_prompt, ["The cat sat on the mat.", "The dog ran"])
        ...     scores = pool.run(induction_per_prompt, repeated_random_tokens(model, 20, 8), seq_len=20)
    """

    def __init__(self, model: Union[str, Path] = "smollm2-135m", *, workers: int = 2, address: Optional[str] = None,
                 num_gpus: float = 0, cpus_per_worker: Optional[int] = None, load_kwargs: Optional[dict] = None,
                 max_retries: int = 2):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InputError(f"workers must be a whole number of at least 1, got {workers!r}")
        if cpus_per_worker is not None and (not isinstance(cpus_per_worker, int) or cpus_per_worker < 1):
            raise InputError(f"cpus_per_worker must be a whole number of at least 1, got {cpus_per_worker!r}")
        if not isinstance(num_gpus, (int, float)) or num_gpus < 0:
            raise InputError(f"num_gpus must be a number of GPUs per worker >= 0, got {num_gpus!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise InputError(f"max_retries must be a whole number >= 0, got {max_retries!r}")
        if load_kwargs is not None and not isinstance(load_kwargs, dict):
            raise InputError(f"load_kwargs must be a dict of wb.load_model options, got {type(load_kwargs).__name__}")
        address = address or os.environ.get("RAY_ADDRESS") or None
        self.ray = require("ray", "sharded sweeps")
        self.source = _checked_source(model, remote=address is not None and not self.ray.is_initialized())
        self.workers, self.max_retries = workers, max_retries
        self._load_kwargs = {"progress": False, **(load_kwargs or {})}
        self._device = "cuda" if num_gpus > 0 else "cpu"
        self._started, self._actors = self._connect(address, workers, cpus_per_worker), []
        try:
            self._cpus = cpus_per_worker or self._default_cpus(workers)
            self._check_fits(workers, self._cpus, num_gpus)
            self._actor_class = self.ray.remote(_ShardWorker).options(num_cpus=self._cpus, num_gpus=num_gpus,
                                                                     max_restarts=0, max_task_retries=0)
            self._actors = [self._actor_class.remote(self.source, self._load_kwargs, self._device, self._cpus)
                            for _ in range(workers)]
            self.load_s = self._get([actor.load.remote() for actor in self._actors], "loading the model")
        except BaseException:
            self.close()
            raise

    # -- Ray lifecycle
    def _connect(self, address: Optional[str], workers: int, cpus: Optional[int]) -> bool:
        """Connects to Ray; True when this pool started (or joined) it and must shut it down."""
        if self.ray.is_initialized():
            return False
        quiet = dict(log_to_driver=False, logging_level=logging.ERROR)
        if address:
            self.ray.init(address=address, **quiet)
        else:
            cores = os.cpu_count() or 1
            path = os.pathsep.join(p for p in (_repo_root(), os.environ.get("PYTHONPATH")) if p)
            self.ray.init(num_cpus=max(cores, workers * (cpus or 1)), include_dashboard=False,
                          runtime_env={"env_vars": {"PYTHONPATH": path}}, **quiet)
        return True

    def _default_cpus(self, workers: int) -> int:
        nodes = [node["Resources"].get("CPU", 0) for node in self.ray.nodes() if node.get("Alive")]
        total = int(self.ray.cluster_resources().get("CPU", 0))
        return max(1, min(int(max(nodes, default=1)), total // workers))

    def _check_fits(self, workers: int, cpus: int, gpus: float) -> None:
        have = self.ray.cluster_resources()
        if workers * cpus > have.get("CPU", 0) or workers * gpus > have.get("GPU", 0):
            raise InputError(f"{workers} workers x ({cpus} CPUs, {gpus} GPUs) do not fit the Ray cluster's "
                             f"{have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs; use fewer workers or "
                             f"cpus_per_worker/num_gpus")

    def _get(self, refs: list, what: str) -> list:
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayTaskError as error:
            raise error.as_instanceof_cause() from None
        except self.ray.exceptions.RayActorError as error:
            raise ShardFailedError(f"a worker died while {what}: {error}") from error

    def close(self) -> None:
        """Stops the workers, and Ray too when this pool started it.

        Example:
            >>> pool = WorkerPool("toy-attn-2l", workers=1); pool.close()   # doctest: +SKIP
        """
        for actor in self._actors:
            self.ray.kill(actor, no_restart=True)
        self._actors = []
        if self._started:
            self.ray.shutdown()
            self._started = False

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fresh_actor(self, slot: int) -> None:
        """Replaces the actor in ``slot`` (dead) with a new one that has loaded the model."""
        self.ray.kill(self._actors[slot], no_restart=True)
        self._actors[slot] = self._actor_class.remote(self.source, self._load_kwargs, self._device, self._cpus)
        self._get([self._actors[slot].load.remote()], "loading the model on a replacement worker")

    # -- sweeps
    def run(self, fn: Callable, dataset: Dataset, *, attention_mask: Optional[Tensor] = None,
            shard_size: Optional[int] = None, progress: ProgressArg = True, trim_padding: bool = True,
            _die_on_first_attempt: Collection[int] = (), **fn_kwargs) -> pd.DataFrame:
        """``fn(model, shard, **fn_kwargs)`` over every shard of ``dataset``: one DataFrame in dataset order.

        ``shard_size`` prompts per shard (default: a quarter of an even split per worker, at most
        64). ``progress`` (bool or ``(done, total)`` callable) counts prompts as shards finish.
        ``attrs["sharding"]`` holds the shard count, reruns and seconds; attrs lists ending in
        ``_per_prompt`` are joined in dataset order. ``_die_on_first_attempt`` (tests only): shard
        indices whose worker process exits (``os._exit(1)``) on their first attempt.

        Example:
            >>> from experiments.ablation import head_sweep_per_prompt
            >>> tokens_BP, mask_BP = model.to_tokens_and_mask(["The cat sat on the mat.", "The dog ran", "A cat"])
            >>> with WorkerPool("toy-attn-2l", workers=2) as pool:                 # doctest: +SKIP
            ...     rows = pool.run(head_sweep_per_prompt, tokens_BP, attention_mask=mask_BP, shard_size=1)
        """
        n = checked_sweep(fn, dataset, attention_mask, shard_size)
        size = shard_size or min(MAX_SHARD, math.ceil(n / (4 * self.workers)))
        if not self._actors:
            raise InputError("this WorkerPool is closed")
        spans = [(start, min(start + size, n)) for start in range(0, n, size)]
        payloads = [self.ray.put(shard_payload(dataset, attention_mask, a, b, trim_padding)) for a, b in spans]
        kwargs_ref, die = self.ray.put(fn_kwargs), frozenset(int(i) for i in _die_on_first_attempt)
        crashes = (self.ray.exceptions.RayActorError, self.ray.exceptions.WorkerCrashedError)
        attempts, results, in_flight = [0] * len(spans), {}, {}
        pending, idle = deque(range(len(spans))), deque(range(len(self._actors)))
        started = time.perf_counter()
        with Progress(progress, total=n, desc=f"sharded {getattr(fn, '__name__', 'sweep')}") as bar:
            while pending or in_flight:
                while pending and idle:
                    shard, slot = pending.popleft(), idle.popleft()
                    ref = self._actors[slot].run.remote(fn, shard, attempts[shard], die, payloads[shard], kwargs_ref)
                    in_flight[ref] = (shard, slot)
                [ref], _ = self.ray.wait(list(in_flight), num_returns=1)
                shard, slot = in_flight.pop(ref)
                start, stop = spans[shard]
                try:
                    frame = self.ray.get(ref)
                except crashes as error:
                    attempts[shard] += 1
                    if attempts[shard] > self.max_retries:
                        raise ShardFailedError(f"shard {shard} (prompts {start}..{stop - 1}) failed on "
                                               f"{attempts[shard]} workers; the last error: {error}") from error
                    self._fresh_actor(slot)
                    pending.appendleft(shard)
                    idle.append(slot)
                    continue
                except self.ray.exceptions.RayTaskError as error:
                    cause = error.as_instanceof_cause()
                    cause.add_note(f"raised by {getattr(fn, '__name__', fn)} on shard {shard} (prompts {start}..{stop - 1})")
                    raise cause from None
                results[shard] = checked_rows(frame, fn, shard, start, stop)
                idle.append(slot)
                bar.advance(stop - start)
        frames = [results[i] for i in range(len(spans))]
        table = pd.concat(frames, ignore_index=True).sort_values("prompt", kind="stable", ignore_index=True)
        table.attrs = {**merged_attrs(frames), "sharding": {
            "workers": self.workers, "shards": len(spans), "shard_size": size, "reruns": sum(attempts),
            "seconds": time.perf_counter() - started, "load_s": list(self.load_s)}}
        return table


def run_sharded(fn: Callable, dataset: Dataset, model: Union[str, Path] = "smollm2-135m", *, workers: int = 2,
                address: Optional[str] = None, attention_mask: Optional[Tensor] = None,
                shard_size: Optional[int] = None, progress: ProgressArg = True, load_kwargs: Optional[dict] = None,
                num_gpus: float = 0, cpus_per_worker: Optional[int] = None, max_retries: int = 2,
                trim_padding: bool = True, _die_on_first_attempt: Collection[int] = (), **fn_kwargs) -> pd.DataFrame:
    """Runs ``fn(model, shard, **fn_kwargs)`` over ``dataset`` on ``workers`` Ray workers: per-prompt rows in dataset order.

    One ``WorkerPool`` for one sweep (see the module docstring for datasets, padding, faults and
    the Ray lifecycle); the arguments are ``WorkerPool``'s and ``WorkerPool.run``'s. Arguments are
    checked (and ``model`` resolved) before Ray starts.

    Example:
        >>> from experiments.datasets import ioi_dataset
        >>> from experiments.ioi import ioi_per_prompt, ioi_result
        >>> data = ioi_dataset(model, 24, names=["man", "one", "two", "time", "they"])
        >>> rows = run_sharded(ioi_per_prompt, data, "toy-attn-2l", workers=2)                # doctest: +SKIP
        >>> result = ioi_result(rows)          # == ioi_patching(model, data), up to float noise  # doctest: +SKIP
    """
    checked_sweep(fn, dataset, attention_mask, shard_size)  # before the pool starts Ray
    with WorkerPool(model, workers=workers, address=address, num_gpus=num_gpus, cpus_per_worker=cpus_per_worker,
                    load_kwargs=load_kwargs, max_retries=max_retries) as pool:
        return pool.run(fn, dataset, attention_mask=attention_mask, shard_size=shard_size, progress=progress,
                        trim_padding=trim_padding, _die_on_first_attempt=_die_on_first_attempt, **fn_kwargs)

