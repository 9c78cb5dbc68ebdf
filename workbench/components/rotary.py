"""Rotary position embedding (RoPE): full or partial, halves or adjacent pairs, scaled; ALiBi slopes.

Legend: B batch, P position, H n_heads, K d_head, R rotary_dim.

By default dimension i is paired with i + R/2 ("rotate half", GPT-NeoX / Llama in `transformers`).
With ``rotary_adjacent_pairs`` (GPT-J) dimension 2i is paired with 2i + 1. (GGUF files store llama
Q/K rows permuted for llama.cpp's interleaved pairing; the GGUF loader undoes that permutation.)

``rotary_scaling`` follows `transformers`' ``rope_type`` values and formulas
(``modeling_rope_utils``): ``linear`` divides every frequency by ``factor``; ``llama3`` divides the
low frequencies by ``factor`` and blends the middle band; ``yarn`` blends interpolated and
extrapolated frequencies over a correction range and multiplies cos and sin by an attention
factor; ``dynamic`` (NTK) raises the base once a sequence runs past ``n_ctx``, from the longest
position of the current call (as `transformers` recomputes it per forward); ``longrope`` (Phi-3/3.5)
divides each frequency by its own ``short_factor`` while the call's longest position stays within
``original_max_position_embeddings`` and by its ``long_factor`` beyond, and multiplies cos and sin by
an attention factor (given, or sqrt(1 + ln(factor) / ln(original)) with factor = n_ctx / original).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Optional

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from workbench.config import ModelConfig

Scaling = Optional[tuple[tuple[str, Any], ...]]  # rotary_scaling as a hashable, sorted tuple of items


# The angles of the last (positions, table, dtype) seen: shared by all layers of one forward pass.
_LAST_ANGLES: list[Optional[tuple]] = [None]
# Rows of the table built with the model. A longer context gets rows as positions reach them (doubling), so a
# config's n_ctx alone never allocates: a hostile max_position_embeddings=1e8 would ask for gigabytes.
INITIAL_POSITIONS = 32768


class Rotary(nn.Module):
    """Rotates the first ``rotary_dim`` dimensions of each head by position-dependent angles.

    Example:
        >>> rotary = Rotary(model.cfg)
        >>> q = cache["blocks.0.attn.hook_q"]   # [batch, pos, n_heads, d_head]
        >>> torch.equal(rotary(q, torch.arange(q.shape[1])), cache["blocks.0.attn.hook_rot_q"])
        True
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.rotary_dim, self.base, self.n_ctx = cfg.rotary_dim, cfg.rotary_base, cfg.n_ctx
        self.adjacent_pairs = cfg.rotary_adjacent_pairs
        self.scaling: Scaling = None if cfg.rotary_scaling is None else tuple(sorted(
            (key, tuple(value) if isinstance(value, list) else value) for key, value in cfg.rotary_scaling.items()))
        self.dynamic = (cfg.rotary_scaling or {}).get("rope_type") == "dynamic"
        # longrope: calls longer than this use the long factors (the table built here has the short ones)
        self.regime_length = cfg.rotary_regime_length
        with torch.device("cpu"):  # a real (and cached) table even when the model is built on the meta device
            cos, sin = rotary_table(cfg.n_ctx, cfg.rotary_dim, cfg.rotary_base, self.scaling,
                                    adjacent_pairs=self.adjacent_pairs, length=min(cfg.n_ctx, INITIAL_POSITIONS))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, x_BPHK: Float[Tensor, "batch pos heads d_head"], positions: Int[Tensor, "*batch pos"]
    ) -> Float[Tensor, "batch pos heads d_head"]:
        """``positions``: [P], or [B, P] when each row has its own (padded batches)."""
        cos_P1R, sin_P1R = self._head_angles(positions, x_BPHK.dtype)
        if self.rotary_dim == x_BPHK.shape[-1]:
            return rotated(x_BPHK, cos_P1R, sin_P1R, self.adjacent_pairs)
        rot, rest = x_BPHK[..., : self.rotary_dim], x_BPHK[..., self.rotary_dim :]
        return torch.cat([rotated(rot, cos_P1R, sin_P1R, self.adjacent_pairs), rest], dim=-1)

    def _head_angles(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [P, 1, R] (or [B, P, 1, R]) in ``dtype``. Every layer of a forward pass gets the same
        ``positions`` tensor and, with the same rotary config, the same cached table: the angles are
        gathered once per forward, not once per layer (a tenth of a decoding step's small ops)."""
        key = (positions, self.cos, dtype)
        memo = _LAST_ANGLES[0]
        if memo is not None and all(a is b for a, b in zip(memo[0], key)):
            return memo[1]
        cos_PR, sin_PR = self._angles(positions)  # [P, R] or [B, P, R]
        angles = cos_PR.unsqueeze(-2).to(dtype), sin_PR.unsqueeze(-2).to(dtype)
        _LAST_ANGLES[0] = (key, angles)  # one assignment: a concurrent forward sees the old or the new pair
        return angles

    def _angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # Only dynamic scaling, and a table not yet grown to n_ctx, read the longest position (a device sync on GPU).
        # Positions on the meta device (plan_memory's pass) have a shape but no values: nothing grows for them.
        short = self.cos.shape[0] < self.n_ctx
        measure = (self.dynamic or short or self.regime_length) and positions.numel() and not positions.is_meta
        seq_len = int(positions.max()) + 1 if measure else 0
        if short and seq_len > self.cos.shape[0]:
            self._grow(seq_len)
        if self.regime_length is not None and seq_len > self.regime_length:  # longrope's long factors
            cos, sin = rotary_table(self.n_ctx, self.rotary_dim, self.base, self.scaling, self.regime_length + 1,
                                    adjacent_pairs=self.adjacent_pairs,
                                    length=max(seq_len, min(self.n_ctx, INITIAL_POSITIONS)))
            return cos.to(self.cos.device)[positions], sin.to(self.sin.device)[positions]
        if self.dynamic and seq_len > self.n_ctx:  # NTK: a base fitted to this call's longest position
            cos, sin = rotary_table(self.n_ctx, self.rotary_dim, self.base, self.scaling, seq_len,
                                    adjacent_pairs=self.adjacent_pairs)
            return cos.to(self.cos.device)[positions], sin.to(self.sin.device)[positions]
        return self.cos[positions], self.sin[positions]

    def _grow(self, seq_len: int) -> None:
        """The table extended to cover ``seq_len`` positions (doubling, at most ``n_ctx``): the same values for
        the rows it had, as each row depends on its position only."""
        rows = min(self.n_ctx, max(seq_len, 2 * self.cos.shape[0]))
        with torch.device("cpu"):
            cos, sin = rotary_table(self.n_ctx, self.rotary_dim, self.base, self.scaling,
                                    adjacent_pairs=self.adjacent_pairs, length=rows)
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)


def inverse_frequencies(rotary_dim: int, base: float, scaling: Scaling = None, n_ctx: int = 0,
                        seq_len: int = 0) -> tuple[Float[Tensor, "half_rotary_dim"], float]:
    """RoPE's inverse frequencies (float64) and the factor cos/sin are multiplied by.

    ``n_ctx`` is the model's context (transformers' ``max_position_embeddings``), which ``dynamic``
    scaling compares ``seq_len`` with.

    Example:
        >>> inv, factor = inverse_frequencies(4, 10000.0, (("factor", 2.0), ("rope_type", "linear")))
        >>> inv.tolist(), factor
        ([0.5, 0.005], 1.0)
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    spec = dict(scaling or ())
    kind, factor = spec.get("rope_type"), spec.get("factor", 1.0)
    if kind == "dynamic" and seq_len > n_ctx:
        base = base * ((factor * seq_len / n_ctx) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    inv_freq = 1.0 / base ** exponents
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, spec), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, base, rotary_dim, spec, n_ctx)
    if kind == "longrope":
        return _longrope(inv_freq, spec, n_ctx, seq_len)
    return inv_freq, 1.0


def _longrope(inv_freq: Tensor, spec: dict[str, Any], n_ctx: int, seq_len: int) -> tuple[Tensor, float]:
    """Each frequency divided by its short (or, for calls past the original context, long) factor; the
    attention factor as given or from factor = n_ctx / original (transformers' ``_compute_longrope_parameters``)."""
    original = spec["original_max_position_embeddings"]
    factor = spec.get("factor") or n_ctx / original
    attention_factor = spec.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    divisors = spec["long_factor"] if seq_len > original else spec["short_factor"]
    return inv_freq / torch.tensor(divisors, dtype=torch.float64), float(attention_factor)


def _llama3(inv_freq: Tensor, spec: dict[str, Any]) -> Tensor:
    factor, low, high = spec["factor"], spec["low_freq_factor"], spec["high_freq_factor"]
    old_context = spec["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context grown ``scale``-fold (1 when it has not grown).

    Example:
        >>> round(yarn_mscale(4.0, 1.0), 4)
        1.1386
    """
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(inv_freq: Tensor, base: float, dim: int, spec: dict[str, Any], n_ctx: int) -> tuple[Tensor, float]:
    original = spec["original_max_position_embeddings"]
    factor = spec.get("factor") or n_ctx / original

    attention_factor = spec.get("attention_factor")
    if attention_factor is None:
        m, m_all = spec.get("mscale"), spec.get("mscale_all_dim")
        attention_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(spec.get("beta_fast") or 32), correction_dim(spec.get("beta_slow") or 1)
    if spec.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate (divide by factor)
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


@lru_cache(maxsize=16)
def rotary_table(n_ctx: int, rotary_dim: int, base: float, scaling: Scaling = None, seq_len: int = 0,
                 adjacent_pairs: bool = False, length: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """cos and sin [n_ctx, R] (or the first ``length`` rows) of the rotation angles (float32; computed in
    float64), the attention factor of ``yarn`` included. ``seq_len`` > ``n_ctx`` only for ``dynamic`` scaling. Each
    frequency appears twice, laid out as the rotation pairs dimensions: (f0..fn, f0..fn) for
    halves, (f0, f0, f1, f1, ...) for adjacent pairs.

    Cached: every layer of a model shares one table (float64 cos/sin over 8192 x 64 angles takes
    ~0.1 s on a small CPU; recomputed per layer it dominated loading a 30-layer model). Buffers
    are never written in place, so sharing is safe; ``.to()`` gives each module its own copy.

    Example:
        >>> cos, sin = rotary_table(n_ctx=3, rotary_dim=2, base=10000.0)   # one frequency: angle = position
        >>> cos.round(decimals=4)
        tensor([[ 1.0000,  1.0000],
                [ 0.5403,  0.5403],
                [-0.4161, -0.4161]])
    """
    inv_freq, attention_factor = inverse_frequencies(rotary_dim, base, scaling, n_ctx, seq_len)
    length = max(n_ctx, seq_len) if length is None else length
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [n_ctx, R/2]
    angles = angles.repeat_interleave(2, dim=-1) if adjacent_pairs else torch.cat([angles, angles], dim=-1)  # [n_ctx, R]
    return (angles.cos() * attention_factor).float(), (angles.sin() * attention_factor).float()


def rotated(x: Float[Tensor, "... dim"], cos: Float[Tensor, "... dim"], sin: Float[Tensor, "... dim"],
            adjacent_pairs: bool = False) -> Float[Tensor, "... dim"]:
    """x cos + rotate(x) sin: the rotation of each pair (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).

    The pairs are the two halves of the last dimension (Llama's ``rotate_half``: (x1, x2) -> (-x2, x1)) or,
    with ``adjacent_pairs``, neighbours (GPT-J's ``rotate_every_two``: (x0, x1, ...) -> (-x1, x0, ...)). The
    rotated term is added in place to x cos, half by half, instead of being built as a tensor of its own:
    one product and two half-size updates (0.74 ms instead of 1.45 for [2048, 9, 64]), bit for bit what
    ``torch.addcmul(x * cos, rotate(x), sin)`` gives.

    Example:
        >>> x, angle = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.full((4,), math.pi / 2)   # two pairs
        >>> (rotated(x, angle.cos(), angle.sin()).round(decimals=4) + 0.0).tolist()   # pairs (1, 0), (0, 1) turned 90 degrees
        [0.0, -1.0, 1.0, 0.0]
    """
    if adjacent_pairs:
        first, second = slice(0, None, 2), slice(1, None, 2)
    else:
        half = x.shape[-1] // 2
        first, second = slice(0, half), slice(half, None)
    out = x * cos
    out[..., first].addcmul_(x[..., second], sin[..., first], value=-1)
    out[..., second].addcmul_(x[..., first], sin[..., second])
    return out


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
