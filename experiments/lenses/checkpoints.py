"""A tuned-lens training run's checkpoint: translators, optimizer, schedule, step, tokens, data cursor and log in one
``checkpoint.pt`` (written atomically through ``save_files``, read only with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import torch

from workbench.errors import CheckpointError
from workbench.safe_files import save_files

CHECKPOINT_FILE = "checkpoint.pt"


def save_checkpoint(path: Path, lens, opt, schedule, state: dict, n_steps: int) -> None:
    """Writes the run's state to ``path`` (atomically); ``resume``'s example reads back what it writes."""
    payload = {"translators": lens.layer_translators.state_dict(), "optimizer": opt.state_dict(),
               "schedule": schedule.state_dict(), "n_steps": n_steps, "config": lens.config.to_dict(),
               "step": state["step"], "tokens": state["tokens"], "cursor": state["cursor"], "log": state["log"]}
    save_files(path.parent, {path.name: lambda target: torch.save(payload, target)}, what="tuned lens checkpoint")


def read_checkpoint(checkpoint_dir: Union[str, Path]) -> dict:
    """The payload of ``checkpoint_dir``'s checkpoint, or a ``CheckpointError`` naming the file.

    Example:
        >>> import tempfile
        >>> read_checkpoint(tempfile.mkdtemp())
        Traceback (most recent call last):
        workbench.errors.CheckpointError: ...checkpoint.pt: no tuned lens checkpoint there
    """
    path = Path(checkpoint_dir) / CHECKPOINT_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no tuned lens checkpoint there")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{path}: not a tuned lens checkpoint ({type(error).__name__}: {error})") from None
    if not isinstance(payload, dict) or not {"translators", "config", "log", "n_steps"} <= set(payload):
        raise CheckpointError(f"{path}: not a tuned lens checkpoint (keys missing)")
    return payload


def resume(checkpoint_dir: Path, lens, opt, schedule, n_steps: int) -> dict:
    """Puts the checkpoint's translators, optimizer and schedule back; returns the run's step, tokens, cursor, log.
    A checkpoint of another lens or run length is refused.

    Example:
        >>> import tempfile
        >>> from experiments.lenses import TunedLens
        >>> lens = TunedLens.for_model(model)
        >>> opt = torch.optim.Adam(lens.parameters())
        >>> schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        >>> folder = Path(tempfile.mkdtemp())
        >>> run = {"step": 3, "tokens": 96, "cursor": 3, "log": []}
        >>> save_checkpoint(folder / CHECKPOINT_FILE, lens, opt, schedule, run, n_steps=10)
        >>> resume(folder, lens, opt, schedule, 10)
        {'step': 3, 'tokens': 96, 'cursor': 3, 'log': []}
        >>> resume(folder, lens, opt, schedule, 20)   # a run of another length
        Traceback (most recent call last):
        workbench.errors.CheckpointError: .../checkpoint.pt: was written for another lens or run ...
    """
    payload = read_checkpoint(checkpoint_dir)
    if payload.get("config") != lens.config.to_dict() or payload.get("n_steps") != n_steps:
        raise CheckpointError(f"{Path(checkpoint_dir) / CHECKPOINT_FILE}: was written for another lens or run "
                              f"({payload.get('config')}, {payload.get('n_steps')} steps); this one is "
                              f"{lens.config.to_dict()}, {n_steps} steps. Use a new checkpoint_dir or the same arguments")
    lens.load_state_dict(payload["translators"])
    for p in lens.parameters():
        p.requires_grad_(True)
    opt.load_state_dict(payload["optimizer"])
    schedule.load_state_dict(payload["schedule"])
    return {key: payload[key] for key in ("step", "tokens", "cursor", "log")}
