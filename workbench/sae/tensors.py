"""The one check of an SAE's tensors against its config: names, shapes and finite values."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from workbench.sae.architectures import architecture_spec
from workbench.sae.config import SAEConfig


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
    spec = architecture_spec(cfg.architecture_name)
    shapes = spec.weight_shapes(cfg.d_in, cfg.d_sae, cfg.d_out)
    missing = [name for name in shapes if name not in tensors]
    extra = sorted(name for name in tensors if name not in shapes)
    stored = f"a {spec.name} SAE stores {', '.join(shapes)}"
    if missing or extra:
        parts = ([f"missing {', '.join(map(repr, sorted(missing)))}"] if missing else []) + \
                ([f"unexpected {', '.join(map(repr, extra))}"] if extra else [])
        raise error(f"{source}: {'; '.join(parts)} ({stored})")
    problems = []
    for name, shape in shapes.items():
        tensor = tensors[name]
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            problems.append(f"tensor {name!r} must be a floating-point tensor, got "
                            f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        elif tuple(tensor.shape) != shape:
            problems.append(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {_axes(name, spec.transcoder)}"
                            f" = {shape}")
        elif not bool(torch.isfinite(tensor).all()):
            problems.append(f"tensor {name!r} holds NaN or infinity")
    if problems:
        raise error(f"{source}: {'; '.join(problems)}")


def _axes(name: str, transcoder: bool) -> str:
    out = "d_out" if transcoder else "d_in"
    return {"W_enc": "[d_in, d_sae]", "W_dec": f"[d_sae, {out}]", "b_dec": f"[{out}]",
            "W_skip": "[d_out, d_in]"}.get(name, "[d_sae]")
