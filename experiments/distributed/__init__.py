"""Experiments bigger than one machine: a per-prompt experiment run over a dataset sharded across Ray workers.

Legend: B batch, P position, S key position, L n_layers, H n_heads.

``run_sharded(fn, dataset, model)`` cuts ``dataset`` into shards of consecutive prompts and runs
``fn(model, shard, **fn_kwargs)`` on Ray workers. ``fn`` returns a DataFrame of per-prompt rows
with a ``prompt`` column numbered within its shard (0..len(shard)-1); the result is one DataFrame
in dataset order (a stable sort by ``prompt``) with ``prompt`` renumbered to dataset indices: for a
``fn`` whose rows are prompt-major, the rows, columns and dtypes of ``fn(model, whole_dataset)``,
with values equal up to float noise (see Padding).

- Datasets: an ``IOIDataset`` (shards by ``IOIDataset.select``), token ids [B, P] with an optional
  ``attention_mask`` [B, P] (sharded alongside, passed to ``fn`` as ``attention_mask=``), or a list
  of texts (``fn`` tokenizes its shard).
- Workers: each is a Ray actor that loads the model once (``wb.load_model`` by registered name or
  path, on "cuda" when it holds a GPU (``num_gpus``), else the CPU, with ``cpus_per_worker`` torch
  threads) and runs shard after shard, the next shard going to whichever worker is free.
  ``WorkerPool`` keeps the workers for several sweeps; ``run_sharded`` is one pool for one sweep.
- Padding: a shard keeps only the columns some of its rows use (``trim_padding=True``), so it runs
  at its own width. Masked rows give the numbers they give alone (``tests/integration/
  test_padding_parity.py``), so trimming and the smaller batch change results by float noise only:
  measured on SmolLM2-135M float32, at most 4e-5 on logit differences and losses (tests use 1e-4).
  Pass ``trim_padding=False`` to a ``fn`` whose rows are per padded column.
- Faults: a worker that dies (``RayActorError``/``ActorDiedError``, ``WorkerCrashedError``) is replaced
  by a fresh actor and its shard rerun; results are keyed by shard index, so nothing is lost or
  counted twice. After ``max_retries`` reruns of one shard, ``ShardFailedError`` names it. An
  exception raised by ``fn`` itself is not retried: it is raised in the driver (an instance of the
  original class) with a note naming the shard.
- Ray: by default a local Ray is started for the pool (quiet: no dashboard, workers' logs not
  forwarded) and shut down after it; ``address=`` or the ``RAY_ADDRESS`` variable connects to an
  existing cluster instead (the driver disconnects after, the cluster keeps running); a Ray the
  caller already initialised is used as it is and left running.

Ready-made per-prompt experiments live beside the experiment they split (top-level functions, so
workers import them): ``experiments.ioi.ioi_per_prompt`` (IOI logit differences and every head's
patching effect; ``ioi_result`` rebuilds ``ioi_patching``'s result), ``experiments.ablation.head_sweep_per_prompt``,
``experiments.induction.induction_per_prompt`` and ``induction_loss_per_prompt``; ``mean_over_prompts``
turns their rows into the dataset-level tables of ``head_sweep`` and ``induction_scores``.

Modules: ``shards`` (cutting a dataset, joining rows back, ``mean_over_prompts``) and ``pool``
(``WorkerPool``, ``run_sharded``, ``ShardFailedError``); every public name is importable from here.
"""

from experiments.distributed.pool import ShardFailedError, WorkerPool, run_sharded
from experiments.distributed.shards import mean_over_prompts

__all__ = ["run_sharded", "WorkerPool", "ShardFailedError", "mean_over_prompts"]
