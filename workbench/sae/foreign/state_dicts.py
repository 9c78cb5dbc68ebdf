"""The named tensors a kind needs from a ``.pt`` state dict, read through ``torch.load(weights_only=True)`` only.

DeepSeek R1, Qwen Scope, Goodfire and Connor & Rob's hook_z SAEs are pickled state dicts; each kind names the
entries it converts, and a missing entry or one that is not a tensor is a ``CheckpointError`` naming the file
(never a bare ``KeyError``). Entries it does not name are ignored, as SAELens's loaders ignore them.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from workbench.errors import CheckpointError
from workbench.sae.foreign.kinds import read_torch


def pt_tensors(path: Path, names: tuple[str, ...]) -> dict[str, Tensor]:
    """The entries ``names`` of the weights-only ``.pt`` file at ``path``, each a tensor.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "sae.pt"
        >>> torch.save({"encoder.weight": torch.ones(3, 2)}, path)
        >>> pt_tensors(path, ("encoder.weight",))["encoder.weight"].shape
        torch.Size([3, 2])
        >>> pt_tensors(path, ("encoder.weight", "encoder.bias"))
        Traceback (most recent call last):
        workbench.errors.CheckpointError: .../sae.pt: missing 'encoder.bias' (the file holds 'encoder.weight')
    """
    state = read_torch(path)
    missing = [name for name in names if name not in state]
    if missing:
        held = ", ".join(repr(str(key)) for key in list(state)[:20])
        raise CheckpointError(f"{path}: missing {', '.join(map(repr, missing))} (the file holds {held or 'nothing'})")
    wrong = [name for name in names if not isinstance(state[name], Tensor)]
    if wrong:
        raise CheckpointError(f"{path}: {', '.join(map(repr, wrong))} must be tensors, got "
                              f"{', '.join(type(state[name]).__name__ for name in wrong)}")
    return {name: state[name] for name in names}
