"""Putting a dict of named tensors into a ``Decoder``, checking every name and shape first.

Every loader ends here, so a missing tensor, an unexpected one or a wrong shape is reported
the same way, naming the file and the tensor, before the model is touched.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from workbench.errors import CheckpointError


def assign_weights(model: torch.nn.Module, tensors: Mapping[str, Tensor], source: str, *, move: bool = False) -> None:
    """Copies ``tensors`` into ``model``'s parameters (cast to their dtype), or raises.

    Raises ``CheckpointError`` naming ``source`` and the tensor when a parameter is missing, a
    tensor is not a parameter of this model, a shape differs, or an integer/bool tensor would be
    cast into a float parameter (see ``check_weights``). Tied parameters (the same
    Parameter under two names) need only one of their names. With ``move=True`` the caller hands
    the tensors over (freshly read from a file): each becomes its parameter's storage instead of
    being copied, which saves a full pass over a large checkpoint's memory. A parameter still on the meta
    device (a model built by ``build.empty_model``) gets the tensor swapped in, the Parameter object (and any
    tie) kept: a model is built once, on meta, checked and filled, never built twice.

    Example:
        >>> assign_weights(model, {name: p.detach().clone() for name, p in model.named_parameters()}, "a copy")
        >>> assign_weights(model, {"embed.W_E": model.embed.W_E.detach()}, "one tensor")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: one tensor: missing tensor(s) ['blocks.0.ln1.w', ...
    """
    expected = check_weights(model, tensors, source)
    with torch.no_grad():
        for name, tensor in tensors.items():
            param = expected[name]
            if param.is_meta:  # no storage to copy into or to share: the filled Parameter takes the tensor's place
                filled = torch.nn.Parameter(tensor.to(param.dtype).contiguous(), requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, filled)
            elif move and tensor.device == param.device:
                param.data = tensor.to(param.dtype).contiguous()  # the Parameter object (and any tie) stays
            else:
                param.copy_(tensor.to(param.dtype))


def check_weights(model: torch.nn.Module, tensors: Mapping[str, Tensor], source: str) -> dict[str, Tensor]:
    """``model``'s state dict (parameters as themselves), once every tensor's name and shape is checked.

    ``CheckpointError`` naming ``source`` and the tensor when a parameter is missing, a tensor is not
    a parameter of this model, a shape differs, or a float parameter's tensor is not floating-point
    (integer, bool or complex: no cast would be right). Tied parameters need only one of their names.

    Example:
        >>> check_weights(torch.nn.Linear(2, 3), {"weight": torch.zeros(3, 2), "bias": torch.zeros(3)}, "x")["bias"].shape
        torch.Size([3])
        >>> check_weights(torch.nn.Linear(2, 3), {"weight": torch.zeros(3, 2, dtype=torch.int64), "bias": torch.zeros(3)}, "x")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: x: tensor 'weight' has dtype torch.int64, which cannot be the floating-point parameter torch.float32 (a corrupt or foreign checkpoint)
    """
    expected = model.state_dict(keep_vars=True)
    by_identity: dict[int, list[str]] = {}
    for name, param in expected.items():
        by_identity.setdefault(id(param), []).append(name)
    missing = [names[0] for names in by_identity.values() if not any(n in tensors for n in names)]
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {missing}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) {unexpected} (not parameters of this model)")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{source}: tensor '{name}' has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
        if expected[name].is_floating_point() and not tensor.is_floating_point():
            # Casting ids, flags or complex values to a float parameter would load nonsense without a word.
            raise CheckpointError(f"{source}: tensor '{name}' has dtype {tensor.dtype}, which cannot be the "
                                  f"floating-point parameter {expected[name].dtype} (a corrupt or foreign checkpoint)")
    return expected
