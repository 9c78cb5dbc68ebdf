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

from workbench.components.rotary import INITIAL_POSITIONS
from workbench.config import ModelConfig
from workbench.components.zero_biases import ZeroBiases
from workbench.options import RuntimeOptions


class Embed(nn.Module):
    """Token id -> vector: ``W_E`` [V, D], times ``embed_scale`` (Gemma's sqrt(d_model)).

    Example:
        >>> model.embed.W_E.shape, torch.equal(model.embed(tokens), cache["hook_embed"])
        (torch.Size([2048, 128]), True)
    """

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
    """Absolute position -> vector: ``W_pos`` [n_ctx, D] (GPT-2).

    Example:
        >>> pos_embed = LearnedPosEmbed(model.config.replace(positional="learned"), model.options)
        >>> pos_embed.W_pos.shape, pos_embed(torch.arange(3)).shape
        (torch.Size([256, 128]), torch.Size([3, 128]))
    """

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model, dtype=options.dtype))

    def forward(self, positions: Int[Tensor, "*batch pos"]) -> Float[Tensor, "*batch pos d_model"]:
        return self.W_pos[positions]


class SinusoidalPosEmbed(nn.Module):
    """A fixed sin/cos table (no parameters): "Attention Is All You Need"'s, or fairseq's
    (``cfg.sinusoidal_style``; ``sinusoidal_table``).

    Example:
        >>> pos_embed = SinusoidalPosEmbed(ModelConfig(n_layers=1, d_model=2, n_heads=1, d_vocab=3, n_ctx=4), RuntimeOptions())
        >>> pos_embed(torch.arange(2)).round(decimals=4)   # (sin p, cos p)
        tensor([[0.0000, 1.0000],
                [0.8415, 0.5403]])
    """

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__()
        self.n_ctx, self.d_model, self.style = cfg.n_ctx, cfg.d_model, cfg.sinusoidal_style
        # Rows for the positions used, as RoPE's table (rotary.INITIAL_POSITIONS): a declared context alone
        # never allocates. A real table even when the model is built on the meta device.
        with torch.device("cpu"):
            table = sinusoidal_table(min(cfg.n_ctx, INITIAL_POSITIONS), cfg.d_model, self.style).to(options.dtype)
        self.register_buffer("table", table, persistent=False)

    def forward(self, positions: Int[Tensor, "*batch pos"]) -> Float[Tensor, "*batch pos d_model"]:
        if self.table.shape[0] < self.n_ctx and positions.numel() and not positions.is_meta:  # meta: shapes only
            self.grow(int(positions.max()) + 1)
        return self.table[positions]

    def grow(self, n_positions: int) -> None:
        """The table extended to cover ``n_positions`` (doubling, at most ``n_ctx``); each row depends on its
        position only, so the rows it had keep their values."""
        if n_positions <= self.table.shape[0]:
            return
        rows = min(self.n_ctx, max(n_positions, 2 * self.table.shape[0]))
        with torch.device("cpu"):
            table = sinusoidal_table(rows, self.d_model, self.style)
        self.table = table.to(device=self.table.device, dtype=self.table.dtype)


# fairseq's sinusoidal table starts at row padding_idx + 1 = 2 (XGLM fixes the offset at 2).
FAIRSEQ_POSITION_OFFSET = 2


def sinusoidal_table(n_ctx: int, d_model: int, style: str = "interleaved") -> Float[Tensor, "n_ctx d_model"]:
    """The first ``n_ctx`` rows of a sinusoidal table (each row depends on its position only).
    "interleaved": PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d)).
    "fairseq" (XGLM's ``XGLMSinusoidalPositionalEmbedding``, half h = d/2): PE[p, i] = sin(q w_i),
    PE[p, h + i] = cos(q w_i) with w_i = 10000^(-i/(h-1)) and q = p + 2; a zero column when d is odd.

    Example:
        >>> sinusoidal_table(4, 8)[0, :2].tolist()
        [0.0, 1.0]
        >>> [round(x, 4) for x in sinusoidal_table(4, 4, "fairseq")[0].tolist()]   # q = 2: sin 2, sin 2e-4, cos 2 ...
        [0.9093, 0.0002, -0.4161, 1.0]
    """
    if style == "fairseq":
        return _fairseq_sinusoidal_table(n_ctx, d_model)
    position = torch.arange(n_ctx, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n_ctx, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)[:, : d_model // 2]
    return table.float()


def _fairseq_sinusoidal_table(n_ctx: int, d_model: int) -> Tensor:
    """Computed in float32 step by step as transformers does, so long positions' angles round alike."""
    half = d_model // 2
    inv_freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))
    angles = (torch.arange(n_ctx, dtype=torch.float32) + FAIRSEQ_POSITION_OFFSET)[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos(), torch.zeros(n_ctx, d_model % 2)], dim=1)


POS_EMBEDS: dict[str, type[nn.Module]] = {"learned": LearnedPosEmbed, "sinusoidal": SinusoidalPosEmbed}


def make_pos_embed(cfg: ModelConfig, options: RuntimeOptions) -> Optional[nn.Module]:
    """The absolute position embedding, or None where position enters inside attention (RoPE, ALiBi).

    Example:
        >>> make_pos_embed(model.config, model.options) is None   # rotary
        True
        >>> make_pos_embed(model.config.replace(positional="sinusoidal"), model.options)
        SinusoidalPosEmbed()
    """
    cls = POS_EMBEDS.get(cfg.positional)
    return cls(cfg, options) if cls else None


class Unembed(ZeroBiases, nn.Module):
    """Residual -> logits: x @ ``W_U`` [D, V] (+ ``b_U`` [V] when ``cfg.unembed_bias``), soft-capped
    to cap * tanh(logits / cap) when ``output_logits_soft_cap`` is set (Gemma 2); x is first multiplied
    by ``logits_scale`` when that is not 1 (Granite's 1 / logits_scaling, Cohere's logit_scale).

    With tied embeddings the decoder points the storage ``_W_U_lin`` at the embedding's own
    ``W_E`` Parameter (one tensor, two names); ``Decoder.save`` writes it once.

    Example:
        >>> torch.equal(model.unembed(cache["ln_final.hook_normalized"]), logits)
        True
    """

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__()
        self.bias_shapes = {"b_U": (cfg.d_vocab,)}  # absent: reads as zeros, as in TransformerLens
        self._W_U_lin = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model, dtype=options.dtype))
        self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab, dtype=options.dtype)) if cfg.unembed_bias else None
        self.soft_cap = cfg.output_logits_soft_cap
        self.logits_scale = cfg.logits_scale

    def forward(self, x_BPD: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        return soft_capped(F.linear(self.scaled_input(x_BPD), self._W_U_lin, self.stored_bias("b_U")), self.soft_cap)

    def scaled_input(self, x_BPD: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        """The unembedding's input times ``logits_scale`` (itself when that is 1).

        Example:
            >>> normed = cache["ln_final.hook_normalized"]
            >>> torch.equal(model.unembed.scaled_input(normed), normed)   # logits_scale 1
            True
        """
        return x_BPD if self.logits_scale == 1.0 else x_BPD * self.logits_scale

    def logits_at(self, x_NkD: Float[Tensor, "... d_model"], ids_NkC: Int[Tensor, "... cand"]) -> Float[Tensor, "... cand"]:
        """The logits of the tokens ``ids`` only ([..., C]: row r's own C candidates), as ``forward`` would give them
        (scale, bias, soft cap), without the other d_vocab - C.

        Example:
            >>> normed = cache["ln_final.hook_normalized"]
            >>> ids = torch.tensor([[[0, 5]] * normed.shape[1]])
            >>> torch.allclose(model.unembed.logits_at(normed, ids), logits[..., [0, 5]], atol=1e-5)
            True
        """
        x = self.scaled_input(x_NkD)
        logits = torch.einsum("...d,...cd->...c", x, self._W_U_lin[ids_NkC])
        bias = self.stored_bias("b_U")
        return soft_capped(logits if bias is None else logits + bias[ids_NkC], self.soft_cap)

    def screened_top_k(self, x_ND: Float[Tensor, "rows d_model"], k: int, screen_dtype: torch.dtype,
                       margin: int = 32) -> tuple[Float[Tensor, "rows top"], Int[Tensor, "rows top"], Float[Tensor, "rows"]]:
        """The ``k`` highest logits of each row with their ids, and the row's logsumexp, from a low-precision screen.

        Every logit is first computed in ``screen_dtype`` (bfloat16 runs 4-5x faster than float32 on CPUs with
        bfloat16 units; the unembedding over a large vocabulary is most of a logit lens); the ``k + margin`` best of the
        screen are computed again in full precision (``logits_at``), and the top k chosen among them, so the values are
        exact and the ids those of the full-precision logits unless a token outside the screen's ``k + margin`` best
        would beat them (its screened logit off by more than the gap). The logsumexp reads the exact candidates and the
        screened rest: its error is the screen's error on the tail's share of the probability mass.

        Example:
            >>> x = cache["ln_final.hook_normalized"][0]
            >>> values, ids, lse = model.unembed.screened_top_k(x, 3, torch.bfloat16)
            >>> exact = logits[0].topk(3)
            >>> torch.equal(ids, exact.indices), torch.allclose(values, exact.values, atol=1e-5)
            (True, True)
            >>> bool((lse - logits[0].logsumexp(-1)).abs().max() < 0.05)
            True
        """
        screen_NV = soft_capped(F.linear(self.scaled_input(x_ND).to(screen_dtype), self.screen_weight(screen_dtype),
                                         None if (bias := self.stored_bias("b_U")) is None else bias.to(screen_dtype)),
                                self.soft_cap)
        candidates_NC = screen_NV.topk(min(k + margin, screen_NV.shape[-1]), dim=-1).indices
        exact_NC = self.logits_at(x_ND, candidates_NC).float()
        lse_N = logsumexp(screen_NV.float().scatter_(-1, candidates_NC, exact_NC))
        values_Nk, order_Nk = exact_NC.topk(min(k, exact_NC.shape[-1]), dim=-1)
        return values_Nk, candidates_NC.gather(-1, order_Nk), lse_N

    def screen_weight(self, dtype: torch.dtype) -> Float[Tensor, "d_vocab d_model"]:
        """The unembedding in ``dtype``, converted once and kept while the weights are unchanged (their storage and
        version), since converting a large vocabulary's matrix costs a good part of the screen itself. What it holds
        from the first screen on: d_vocab x d_model in bfloat16 (SmolLM2-135M 57 MB, Gemma 3 270M 335 MB).

        Example:
            >>> held = model.unembed.screen_weight(torch.bfloat16)
            >>> held.dtype, held.shape == model.unembed.W_U.T.shape, held is model.unembed.screen_weight(torch.bfloat16)
            (torch.bfloat16, True, True)
        """
        key = (dtype, self._W_U_lin.data_ptr(), self._W_U_lin._version)
        held = getattr(self, "_screen_copy", None)
        if held is None or held[0] != key:
            held = (key, self._W_U_lin.detach().to(dtype))
            self._screen_copy = held
        return held[1]

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        """TransformerLens's [D, V] unembedding: a transposed view of the stored [V, D] matrix.

        Example:
            >>> model.unembed.W_U.shape
            torch.Size([128, 2048])
        """
        return self._W_U_lin.T


def logsumexp(x_NV: Float[Tensor, "rows d_vocab"]) -> Float[Tensor, "rows"]:
    """``x.logsumexp(-1)`` through the fused log-softmax kernel: on a CPU thread 2.5x faster over a 49k vocabulary
    (``logsumexp`` makes a pass per step), and exact to float rounding, since log_softmax(x)[0] = x[0] - logsumexp(x).

    Example:
        >>> x = torch.randn(3, 1000) * 50
        >>> torch.allclose(logsumexp(x), x.logsumexp(-1), atol=1e-4)
        True
    """
    return x_NV[..., 0] - x_NV.log_softmax(-1)[..., 0]


def soft_capped(x: Tensor, cap: Optional[float]) -> Tensor:
    """cap * tanh(x / cap), or x itself when ``cap`` is None.

    Example:
        >>> round(soft_capped(torch.tensor([100.0]), 30.0).item(), 3)
        29.924
    """
    return x if cap is None else torch.tanh(x / cap) * cap
