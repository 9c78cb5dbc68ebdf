"""The architectures an SAE can have: a table of what each stores and which activation it applies.

Every architecture SAELens 6 saves for inference is one row: what differs between them is the activation
(ReLU, JumpReLU, top-k, gated), whether it is a transcoder (reads one hook, writes another of width ``d_out``,
no input centring, no output de-normalisation) and whether it has a skip connection (``W_skip``). Batch-top-k
SAEs are saved by SAELens as ``jumprelu`` (their global threshold as a per-feature one), so they are that row.
The arithmetic itself is in ``workbench.sae.math``; nothing asks for an architecture's name but this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from workbench.errors import ConfigError

Activation = Literal["relu", "jumprelu", "topk", "gated"]


@dataclass(frozen=True)
class ArchitectureSpec:
    """One architecture: its activation, whether it is a transcoder, whether it has ``W_skip``."""

    name: str
    activation: Activation
    transcoder: bool = False
    skip: bool = False

    @property
    def top_k(self) -> bool:
        """Whether the config carries ``k`` and ``rescale_acts_by_decoder_norm``."""
        return self.activation == "topk"

    def weight_shapes(self, d_in: int, d_sae: int, d_out: int) -> dict[str, tuple[int, ...]]:
        """The tensors the architecture stores, by SAELens's names, with their shapes.

        Example:
            >>> ARCHITECTURES["gated"].weight_shapes(16, 32, 16)   # doctest: +NORMALIZE_WHITESPACE
            {'W_enc': (16, 32), 'W_dec': (32, 16), 'b_dec': (16,), 'b_gate': (32,), 'b_mag': (32,), 'r_mag': (32,)}
        """
        shapes: dict[str, tuple[int, ...]] = {"W_enc": (d_in, d_sae), "W_dec": (d_sae, d_out), "b_dec": (d_out,)}
        if self.activation == "gated":
            shapes.update(b_gate=(d_sae,), b_mag=(d_sae,), r_mag=(d_sae,))
        else:
            shapes["b_enc"] = (d_sae,)
        if self.activation == "jumprelu":
            shapes["threshold"] = (d_sae,)
        if self.skip:
            shapes["W_skip"] = (d_out, d_in)
        return shapes


ARCHITECTURES: dict[str, ArchitectureSpec] = {spec.name: spec for spec in (
    ArchitectureSpec("standard", "relu"),
    ArchitectureSpec("gated", "gated"),
    ArchitectureSpec("jumprelu", "jumprelu"),
    ArchitectureSpec("topk", "topk"),
    ArchitectureSpec("transcoder", "relu", transcoder=True),
    ArchitectureSpec("skip_transcoder", "relu", transcoder=True, skip=True),
    ArchitectureSpec("jumprelu_transcoder", "jumprelu", transcoder=True),
    ArchitectureSpec("jumprelu_skip_transcoder", "jumprelu", transcoder=True, skip=True),
)}


def architecture_spec(name: object) -> ArchitectureSpec:
    """The row of ``ARCHITECTURES`` named ``name``; a ``ConfigError`` naming the field otherwise.

    Example:
        >>> architecture_spec("topk").activation
        'topk'
        >>> architecture_spec("matryoshka")
        Traceback (most recent call last):
        workbench.errors.ConfigError: SAE config field 'architecture' must be one of ('standard', 'gated', 'jumprelu', 'topk', 'transcoder', 'skip_transcoder', 'jumprelu_transcoder', 'jumprelu_skip_transcoder'), got 'matryoshka'
    """
    spec = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ConfigError(f"SAE config field 'architecture' must be one of {tuple(ARCHITECTURES)}, got {name!r}")
    return spec
