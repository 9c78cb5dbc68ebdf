"""The one check of an SAE's tensors against its config: names, shapes and finite values.

``check_declared`` checks what a file's header declares (names, shapes, dtypes) before any tensor is read, so a
file with an extra or oversized tensor is refused without allocating it; ``check_tensors`` runs the same check on
tensors in memory and then checks their values.
"""

from __future__ import annotations

from typing import Any, Mapping, Union

import torch
from torch import Tensor

from workbench.sae.architectures import architecture_spec
from workbench.sae.config import SAEConfig

# safetensors' names of the floating-point dtypes (its header's "dtype" field).
FLOAT_HEADER_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
DeclaredDtype = Union[torch.dtype, str]  # a torch dtype, a safetensors header dtype, or a non-tensor's type name


def check_declared(cfg: SAEConfig, declared: Mapping[str, tuple[tuple[int, ...], DeclaredDtype]], source: str,
                   error: type[Exception]) -> None:
    """Raises ``error`` (prefixed with ``source``) naming each tensor that is missing, extra, not floating-point or
    of the wrong shape, from ``name -> (shape, dtype)`` alone: what a safetensors header states, read before the data.

    Example:
        >>> cfg = wb.SAEConfig("standard", d_in=2, d_sae=3)
        >>> check_declared(cfg, {"W_enc": ((2,), "F32"), "W_dec": ((3, 2), "F32"), "b_enc": ((3,), "I32"),
        ...                      "b_dec": ((2,), "F32")}, "sae_weights.safetensors", ValueError)
        Traceback (most recent call last):
        ValueError: sae_weights.safetensors: tensor 'W_enc' has shape (2,), expected [d_in, d_sae] = (2, 3); tensor 'b_enc' must be a floating-point tensor, got I32
    """
    problems = _declared_problems(cfg, declared, source, error)
    if problems:
        raise error(f"{source}: {'; '.join(problems)}")


def check_tensors(cfg: SAEConfig, tensors: Mapping[str, Tensor], source: str, error: type[Exception]) -> None:
    """Raises ``error`` (prefixed with ``source``: a file or "SAE tensors") naming each tensor that is missing,
    extra, not a floating tensor, of the wrong shape, or holds NaN or infinity.

    Example:
        >>> cfg = wb.SAEConfig("standard", d_in=2, d_sae=3)
        >>> check_tensors(cfg, {"W_enc": torch.ones(3, 2), "W_dec": torch.ones(3, 2), "b_enc": torch.zeros(3),
        ...                     "b_dec": torch.tensor([0., float("nan")])}, "here", ValueError)
        Traceback (most recent call last):
        ValueError: here: tensor 'W_enc' has shape (3, 2), expected [d_in, d_sae] = (2, 3); tensor 'b_dec' holds NaN or infinity
    """
    declared = {name: _declaration(tensor) for name, tensor in tensors.items()}
    problems = _declared_problems(cfg, declared, source, error)
    shapes = architecture_spec(cfg.architecture_name).weight_shapes(cfg.d_in, cfg.d_sae, cfg.d_out, cfg)
    for name, shape in shapes.items():
        well_declared = _floating(declared[name][1]) and declared[name][0] == shape
        if well_declared and not bool(torch.isfinite(tensors[name]).all()):
            problems.append(f"tensor {name!r} holds NaN or infinity")
    if problems:
        raise error(f"{source}: {'; '.join(problems)}")


def _declared_problems(cfg: SAEConfig, declared: Mapping[str, tuple[tuple[int, ...], DeclaredDtype]], source: str,
                       error: type[Exception]) -> list[str]:
    """Raises for missing or extra names (nothing more is worth checking then); returns each tensor's dtype or
    shape problem."""
    spec = architecture_spec(cfg.architecture_name)
    shapes = spec.weight_shapes(cfg.d_in, cfg.d_sae, cfg.d_out, cfg)
    missing = [name for name in shapes if name not in declared]
    extra = sorted(str(name) for name in declared if name not in shapes)
    if missing or extra:
        parts = ([f"missing {', '.join(map(repr, sorted(missing)))}"] if missing else []) + \
                ([f"unexpected {', '.join(map(repr, extra))}"] if extra else [])
        raise error(f"{source}: {'; '.join(parts)} (a {spec.name} SAE stores {', '.join(shapes)})")
    problems = []
    for name, shape in shapes.items():
        declared_shape, dtype = declared[name]
        if not _floating(dtype):
            problems.append(f"tensor {name!r} must be a floating-point tensor, got {dtype}")
        elif tuple(declared_shape) != shape:
            problems.append(f"tensor {name!r} has shape {tuple(declared_shape)}, expected "
                            f"{_axes(name, spec.transcoder)} = {shape}")
    return problems


def _declaration(tensor: Any) -> tuple[tuple[int, ...], DeclaredDtype]:
    if isinstance(tensor, Tensor):
        return tuple(tensor.shape), tensor.dtype
    return (), type(tensor).__name__


def _floating(dtype: DeclaredDtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return dtype.is_floating_point
    return dtype in FLOAT_HEADER_DTYPES


def _axes(name: str, transcoder: bool) -> str:
    out = "d_out" if transcoder else "d_in"
    if "." in name:  # a submodule's parameter (temporal's attention layers): its shape follows from the config
        return "its layer's shape"
    return {"W_enc": "[d_in, d_sae]", "W_dec": f"[d_sae, {out}]", "b_dec": f"[{out}]",
            "W_skip": "[d_out, d_in]"}.get(name, "[d_sae]")
