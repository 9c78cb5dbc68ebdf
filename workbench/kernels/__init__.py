"""Optional fused GPU kernels.

``triton_flash_attention`` is FlashAttention-2 (forward + backward) in Triton; the
implementation lives in :mod:`workbench.kernels.triton_flash`. This package imports
neither triton nor that module: the function exported here loads it on first call.
That keeps ``import workbench.kernels`` working without triton, and avoids fixing
triton's interpreter mode (``TRITON_INTERPRET`` is read when triton is first
imported) merely because a model module imported this package.
"""

from __future__ import annotations

import importlib.util
import sys

import torch
from jaxtyping import Float

__all__ = ["triton_available", "triton_flash_attention"]


def triton_available() -> bool:
    """True if the ``triton`` package is installed and importable.

    Checked without importing triton (see the module docstring); a triton that is
    already imported counts as available.

    Example:
        >>> isinstance(triton_available(), bool)   # True where the optional triton extra is installed
        True
    """
    if "triton" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def triton_flash_attention(
    q: Float[torch.Tensor, "batch n_heads pos d_head"],
    k: Float[torch.Tensor, "batch n_kv_heads pos d_head"],
    v: Float[torch.Tensor, "batch n_kv_heads pos d_head"],
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    scale: float | None = None,
) -> Float[torch.Tensor, "batch n_heads pos d_head"]:
    """FlashAttention-2 in Triton; see :func:`workbench.kernels.triton_flash.triton_flash_attention`.

    Example (a CUDA GPU only):
        >>> q = torch.randn(1, 8, 256, 64, device="cuda", dtype=torch.bfloat16)   # doctest: +SKIP
        >>> k = v = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)   # doctest: +SKIP
        >>> triton_flash_attention(q, k, v, causal=True, sliding_window=128).shape   # doctest: +SKIP
        torch.Size([1, 8, 256, 64])

    Raises:
        ImportError: triton is not installed (check :func:`triton_available` first).
    """
    if not triton_available():
        raise ImportError(
            "triton_flash_attention needs the 'triton' package, which is not installed "
            "(install the optional triton extra); check workbench.kernels.triton_available() first"
        )
    from workbench.kernels.triton_flash import triton_flash_attention as _impl

    return _impl(q, k, v, causal=causal, sliding_window=sliding_window, scale=scale)
