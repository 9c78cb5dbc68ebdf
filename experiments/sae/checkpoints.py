"""Training checkpoints: written atomically, read back only when they belong to the run resuming from them.

A checkpoint folder (``checkpoint_dir/step-{n}/``) holds ``training_state.pt`` (the module's and Adam's state, the
shuffling buffer's rows and generator, the dead-feature counters, the scales, the step, the log, and the run it
belongs to) and ``step.json``. ``save_checkpoint`` writes them through ``workbench.safe_files.save_files`` (a failed
save leaves the previous checkpoint; no link is written through). ``load_checkpoint`` reads with
``torch.load(weights_only=True, mmap=True)`` (no code runs, no tensor is copied into memory before it is checked)
and refuses, naming the difference, a checkpoint of another architecture, hook, size or batch layout, and any
field of the wrong type or size, before anything is loaded into the module or the optimizer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Union

import torch
from torch import Tensor

from workbench.errors import CheckpointError
from workbench.safe_files import inside, save_files

STATE_FILE = "training_state.pt"
STEP_FILE = "step.json"
# What a run is, for a resume to continue: these must be equal in the checkpoint and the resuming run.
RUN_FIELDS = ("architecture", "k", "input_hooks", "target_hooks", "parameters", "data_shape",
              "train_batch_size_tokens", "buffer_tokens", "store_batch_size_prompts")


def run_identity(module: torch.nn.Module, input_hooks: list[str], target_hooks: list[str], cfg: Any,
                 tokens: Tensor) -> dict[str, Any]:
    """What a checkpoint records of its run and a resume compares: the architecture, ``k``, the hooks, every
    parameter's shape, the data's shape and the batch and buffer sizes.

    Example:
        >>> from experiments.sae.train import TrainSAEConfig
        >>> run = run_identity(torch.nn.Linear(2, 3), ["blocks.0.hook_resid_post"], [], TrainSAEConfig(),
        ...                    torch.zeros(4, 8, dtype=torch.long))
        >>> run["parameters"], run["data_shape"]
        ({'weight': [3, 2], 'bias': [3]}, [4, 8])
    """
    return {"architecture": getattr(module, "architecture", type(module).__name__),
            "k": getattr(module, "options", {}).get("k"), "input_hooks": list(input_hooks),
            "target_hooks": list(target_hooks),
            "parameters": {name: list(tensor.shape) for name, tensor in module.state_dict().items()},
            "data_shape": list(tokens.shape), "train_batch_size_tokens": cfg.train_batch_size_tokens,
            "buffer_tokens": cfg.buffer_tokens, "store_batch_size_prompts": cfg.store_batch_size_prompts}


def save_checkpoint(folder: Union[str, Path], run: dict[str, Any], module: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, buffer_state: dict[str, Any], steps_since_fired: Tensor,
                    scales: Any, step: int, log: list) -> Path:
    """Writes ``training_state.pt`` and ``step.json`` into ``folder`` (through ``save_files``: all or nothing).

    Example:
        >>> import tempfile
        >>> from experiments.sae.activations import ShuffleBuffer
        >>> from experiments.sae.train import TrainSAEConfig
        >>> module = torch.nn.Linear(2, 3)
        >>> run = run_identity(module, ["hook_embed"], [], TrainSAEConfig(), torch.zeros(4, 8, dtype=torch.long))
        >>> buffer = ShuffleBuffer(iter(()), 8, 2, torch.Generator())
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = save_checkpoint(folder, run, module, torch.optim.Adam(module.parameters()), buffer.state(),
        ...                            torch.zeros(3), ([1.0], [1.0]), 0, [])
        ...     sorted(p.name for p in path.iterdir())
        ['step.json', 'training_state.pt']
    """
    state = {"run": run, "sae": module.state_dict(), "optimizer": optimizer.state_dict(), "buffer": buffer_state,
             "tracker": {"steps_since_fired": steps_since_fired}, "scales": list(scales), "step": step,
             "log": list(log)}
    return save_files(folder, {STATE_FILE: lambda path: torch.save(state, path),
                               STEP_FILE: lambda path: path.write_text(json.dumps({"step": step}))},
                      what="checkpoint folder")


def load_checkpoint(folder: Union[str, Path], run: dict[str, Any], module: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, total_steps: int, scale_groups: int,
                    chunk_rows: int) -> dict[str, Any]:
    """The checked state in ``folder`` (``resume_from``), its module and optimizer state loaded into ``module`` and
    ``optimizer``; a ``CheckpointError`` naming the file and what differs or is malformed otherwise.

    ``chunk_rows``: the most rows one chunk of activations adds to the buffer (the buffer's saved rows are
    refused beyond twice ``buffer_tokens`` plus that: the most a buffer holds between two batches).

    Example:
        >>> load_checkpoint("runs/none/step-2", {}, torch.nn.Linear(2, 3), None, 10, 1, 64)
        Traceback (most recent call last):
        workbench.errors.CheckpointError: resume_from: runs/none/step-2 holds no training_state.pt (a checkpoint_dir/step-N folder)
    """
    if not (Path(folder) / STATE_FILE).is_file():
        raise CheckpointError(f"resume_from: {folder} holds no {STATE_FILE} (a checkpoint_dir/step-N folder)")
    path = inside(folder, STATE_FILE, must_exist=True, what="checkpoint folder")
    try:
        state = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file, or one holding code
        raise CheckpointError(f"resume_from: {path} is not a readable training state ({error})") from None
    _check_fields(path, state)
    if "run" in state:  # checkpoints before runs were recorded: the shapes below still guard them
        _check_same_run(path, state["run"], run)
    _check_module_state(path, state["sae"], module)
    _check_counters(path, state, module, total_steps, scale_groups)
    _check_buffer(path, state["buffer"], 2 * (run["buffer_tokens"] + chunk_rows))
    module.load_state_dict(state["sae"])
    try:
        _check_optimizer_shapes(path, state["optimizer"], optimizer)
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"resume_from: {path}: field 'optimizer' does not fit this run's optimizer ({error})") \
            from None
    return state


def _refuse(path: Path, field: str, problem: str) -> CheckpointError:
    return CheckpointError(f"resume_from: {path}: field {field!r} {problem}")


def _check_fields(path: Path, state: Any) -> None:
    if not isinstance(state, dict):
        raise CheckpointError(f"resume_from: {path} is not a training state (a dict expected, got "
                              f"{type(state).__name__})")
    for field, kind in (("sae", dict), ("optimizer", dict), ("buffer", dict), ("tracker", dict), ("scales", list),
                        ("step", int), ("log", list)):
        if field not in state:
            raise _refuse(path, field, "is missing")
        if not isinstance(state[field], kind) or isinstance(state[field], bool):
            raise _refuse(path, field, f"must be a {kind.__name__}, got {type(state[field]).__name__}")
    if "run" in state and not isinstance(state["run"], dict):
        raise _refuse(path, "run", f"must be a dict, got {type(state['run']).__name__}")


def _check_same_run(path: Path, saved: dict[str, Any], run: dict[str, Any]) -> None:
    different = [f"{field} {saved.get(field)!r} there, {run[field]!r} here" for field in RUN_FIELDS
                 if saved.get(field) != run[field]]
    if different:
        raise CheckpointError(f"resume_from: {path} is a checkpoint of another run: " + "; ".join(different))


def _check_module_state(path: Path, saved: dict[str, Any], module: torch.nn.Module) -> None:
    expected = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in module.state_dict().items()}
    found = {name: (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, Tensor) else (None, type(tensor).__name__)
             for name, tensor in saved.items()}
    if found != expected:
        different = sorted(set(found) ^ set(expected)) or [name for name in expected if found[name] != expected[name]]
        raise _refuse(path, "sae", f"holds other parameters than this run's module ({', '.join(different)}: "
                      + "; ".join(f"{n} {found.get(n)} there, {expected.get(n)} here" for n in different[:4]) + ")")


def _check_counters(path: Path, state: dict[str, Any], module: torch.nn.Module, total_steps: int,
                    scale_groups: int) -> None:
    step = state["step"]
    if not 0 <= step <= total_steps:
        raise _refuse(path, "step", f"must be from 0 to this run's total_steps={total_steps}, got {step}")
    fired = state["tracker"].get("steps_since_fired")
    n_features = getattr(module, "n_features", None)
    if not isinstance(fired, Tensor) or not fired.is_floating_point() or list(fired.shape) != [n_features]:
        raise _refuse(path, "tracker.steps_since_fired", f"must be a float tensor [{n_features}], got "
                      f"{list(fired.shape) if isinstance(fired, Tensor) else type(fired).__name__}")
    scales = state["scales"]
    if not (len(scales) == 2 and all(isinstance(side, list) and len(side) == scale_groups and all(
            isinstance(s, float) and math.isfinite(s) and s > 0 for s in side) for side in scales)):
        raise _refuse(path, "scales", f"must be two lists of {scale_groups} positive finite numbers, got "
                      f"{str(scales)[:80]}")
    if len(state["log"]) > step or not all(isinstance(row, dict) for row in state["log"]):
        raise _refuse(path, "log", f"must be at most step={step} rows (dicts), got {len(state['log'])}")


def _check_buffer(path: Path, buffer: dict[str, Any], max_rows: int) -> None:
    for field in ("storage", "ready"):
        rows = buffer.get(field)
        if not isinstance(rows, Tensor) or not (rows.numel() == 0 or rows.dim() == 2 and rows.is_floating_point()):
            raise _refuse(path, f"buffer.{field}", "must be a float tensor [rows, width] (or empty)")
        if len(rows) > max_rows:
            raise _refuse(path, f"buffer.{field}", f"holds {len(rows)} rows, more than this run's buffer can hold "
                          f"({max_rows})")
    widths = {int(buffer[field].shape[1]) for field in ("storage", "ready") if buffer[field].numel()}
    if len(widths) > 1:
        raise _refuse(path, "buffer", f"holds rows of different widths {sorted(widths)}")
    consumed, generator = buffer.get("rows_consumed"), buffer.get("generator")
    if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
        raise _refuse(path, "buffer.rows_consumed", f"must be a whole number, got {consumed!r}")
    expected = torch.Generator().get_state()
    if not isinstance(generator, Tensor) or generator.dtype != expected.dtype or generator.shape != expected.shape:
        raise _refuse(path, "buffer.generator", "is not a CPU generator's state")


def _check_optimizer_shapes(path: Path, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Adam's ``load_state_dict`` checks the groups but not the moments' shapes; a wrong one would fail mid-step."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, moments in (saved.get("state") or {}).items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(moments, dict):
            raise _refuse(path, "optimizer.state", f"names parameter {index!r}, outside this run's {len(params)}")
        for name, value in moments.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != params[index].shape:
                raise _refuse(path, f"optimizer.state[{index}].{name}", f"has shape {list(value.shape)}, the "
                              f"parameter {list(params[index].shape)}")
