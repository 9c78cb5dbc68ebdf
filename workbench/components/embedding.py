"""Token embedding, absolute position embeddings (learned, sinusoidal) and the unembedding.

Legend: B batch, P position, D d_model, V d_vocab.

``W_E`` [V, D], ``W_pos`` [n_ctx, D] and ``W_U`` [D, V] are TransformerLens's names and shapes.
The unembedding is stored in `torch.nn.Linear`'s layout (``_W_U_lin`` [V, D], ``W_U`` is its
transposed view), so the hot path is the same matmul `transformers` runs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from workbench.config import ModelConfig
from workbench.options import RuntimeOptions


class Embed(nn.Module):
    """Token id -> vector: ``W_E`` [V, D], times ``embed_scale`` (Gemma's sqrt(d_model))."""

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model, dtype=options.dtype))
        self.embed_scale = cfg.embed_scale

    def forward(self, tokens_BP: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        embedded = F.embedding(tokens_BP, self.W_E)
        if self.embed_scale == 1.0:
            return embedded
        # The scale rounded to the weights' dtype first, as transformers' Gemma does.
        return embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)


class LearnedPosEmbed(nn.Module):
    """Absolute position -> vector: ``W_pos`` [n_ctx, D] (GPT-2)."""

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model, dtype=options.dtype))

    def forward(self, positions: Int[Tensor, "*batch pos"]) -> Float[Tensor, "*batch pos d_model"]:
        return self.W_pos[positions]


class SinusoidalPosEmbed(nn.Module):
    """The fixed sin/cos table of "Attention Is All You Need" (no parameters)."""

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__()
        with torch.device("cpu"):  # a real table even when the model is built on the meta device
            table = sinusoidal_table(cfg.n_ctx, cfg.d_model).to(options.dtype)
        self.register_buffer("table", table, persistent=False)

    def forward(self, positions: Int[Tensor, "*batch pos"]) -> Float[Tensor, "*batch pos d_model"]:
        return self.table[positions]


def sinusoidal_table(n_ctx: int, d_model: int) -> Float[Tensor, "n_ctx d_model"]:
    """PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d)).

    Example:
        >>> sinusoidal_table(4, 8)[0, :2].tolist()
        [0.0, 1.0]
    """
    position = torch.arange(n_ctx, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n_ctx, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)[:, : d_model // 2]
    return table.float()


POS_EMBEDS: dict[str, type[nn.Module]] = {"learned": LearnedPosEmbed, "sinusoidal": SinusoidalPosEmbed}


def make_pos_embed(cfg: ModelConfig, options: RuntimeOptions) -> Optional[nn.Module]:
    """The absolute position embedding, or None where position enters inside attention (RoPE, ALiBi)."""
    cls = POS_EMBEDS.get(cfg.positional)
    return cls(cfg, options) if cls else None


class Unembed(nn.Module):
    """Residual -> logits: x @ ``W_U`` [D, V] (+ ``b_U`` [V] when ``cfg.unembed_bias``), soft-capped
    to cap * tanh(logits / cap) when ``output_logits_soft_cap`` is set (Gemma 2).

    With tied embeddings the decoder points the storage ``_W_U_lin`` at the embedding's own
    ``W_E`` Parameter (one tensor, two names); ``Decoder.save`` writes it once.
    """

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__()
        self._W_U_lin = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model, dtype=options.dtype))
        self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab, dtype=options.dtype)) if cfg.unembed_bias else None
        self.soft_cap = cfg.output_logits_soft_cap

    def forward(self, x_BPD: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        return soft_capped(F.linear(x_BPD, self._W_U_lin, self.b_U), self.soft_cap)

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self._W_U_lin.T


def soft_capped(x: Tensor, cap: Optional[float]) -> Tensor:
    """cap * tanh(x / cap), or x itself when ``cap`` is None.

    Example:
        >>> round(soft_capped(torch.tensor([100.0]), 30.0).item(), 3)
        29.924
    """
    return x if cap is None else torch.tanh(x / cap) * cap
