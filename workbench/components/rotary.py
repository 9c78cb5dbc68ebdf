"""Rotary position embedding (RoPE), full or partial, and ALiBi slopes.

Legend: B batch, P position, H n_heads, K d_head, R rotary_dim.

We use the "rotate half" pairing of GPT-NeoX / Llama in `transformers`: dimension i is paired
with i + R/2. (GGUF files store llama Q/K rows permuted for llama.cpp's interleaved pairing; the
GGUF loader undoes that permutation so this one convention serves every checkpoint.)
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from workbench.config import ModelConfig


class Rotary(nn.Module):
    """Rotates the first ``rotary_dim`` dimensions of each head by position-dependent angles."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.rotary_dim = cfg.rotary_dim
        cos, sin = rotary_table(cfg.n_ctx, cfg.rotary_dim, cfg.rotary_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, x_BPHK: Float[Tensor, "batch pos heads d_head"], positions_P: Int[Tensor, "pos"]
    ) -> Float[Tensor, "batch pos heads d_head"]:
        cos_P1R = self.cos[positions_P][:, None, :].to(x_BPHK.dtype)
        sin_P1R = self.sin[positions_P][:, None, :].to(x_BPHK.dtype)
        if self.rotary_dim == x_BPHK.shape[-1]:
            return x_BPHK * cos_P1R + rotate_half(x_BPHK) * sin_P1R
        rot, rest = x_BPHK[..., : self.rotary_dim], x_BPHK[..., self.rotary_dim :]
        return torch.cat([rot * cos_P1R + rotate_half(rot) * sin_P1R, rest], dim=-1)


@lru_cache(maxsize=8)
def rotary_table(n_ctx: int, rotary_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos and sin [n_ctx, R] of the rotation angles (float32; computed in float64).

    Cached: every layer of a model shares one table (float64 cos/sin over 8192 x 64 angles takes
    ~0.1 s on a small CPU; recomputed per layer it dominated loading a 30-layer model). Buffers
    are never written in place, so sharing is safe; ``.to()`` gives each module its own copy.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(n_ctx, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [n_ctx, R/2]
    angles = torch.cat([angles, angles], dim=-1)  # [n_ctx, R]
    return angles.cos().float(), angles.sin().float()


def rotate_half(x: Float[Tensor, "... dim"]) -> Float[Tensor, "... dim"]:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def alibi_slopes(n_heads: int) -> Float[Tensor, "n_heads"]:
    """Per-head ALiBi slopes (Press et al.): a geometric sequence, extended for non-powers of two.

    Example:
        >>> alibi_slopes(2).tolist()
        [0.0625, 0.00390625]
    """
    def powers(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = powers(closest)
    if closest < n_heads:
        slopes += powers(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)
