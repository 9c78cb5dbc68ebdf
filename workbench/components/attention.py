"""Multi-head, grouped-query and multi-query causal self-attention with TransformerLens hooks.

Legend: B batch, P position, H n_heads, G n_key_value_heads, K d_head, D d_model, S key position.

Parameters under TransformerLens's names have TransformerLens's shapes and meaning: ``W_Q``
[H, D, K], ``W_K``/``W_V`` [H, D, K] (for GQA expanded per query head; ``_W_K``/``_W_V`` are the
[G, D, K] originals, as in TransformerLens), ``W_O`` [H, K, D], ``b_Q`` [H, K], ``b_K``/``b_V``
[H, K] (``_b_K``/``_b_V`` [G, K]), ``b_O`` [D]; biases exist when ``cfg.attn_bias``. They are
stored in `torch.nn.Linear`'s layout under private names (``_W_Q_lin`` [H*K, D],
``_W_K_lin``/``_W_V_lin`` [G*K, D], ``_W_O_lin`` [D, H*K], ``_b_Q_lin`` [H*K], ``_b_K_lin``/
``_b_V_lin`` [G*K]) so the projections are the single GEMMs `transformers` runs; the
TransformerLens names are views of that storage (writing into ``W_Q``, ``_W_K``, ``_W_V``, ``W_O``,
``b_Q``, ``_b_K`` or ``_b_V`` writes the weights; ``W_K``/``W_V``/``b_K``/``b_V`` of a GQA model are copies).

The kernel is the model's ``options.attn_impl`` (``workbench.options.RuntimeOptions``, switched by
``Decoder.set_attn_impl``), read at each call from the options object the model shares with every
layer, so no copy goes stale. A layer whose ``hook_attn_scores`` or ``hook_pattern`` is observed
(``workbench.hook_point.is_observed``: a hook of any kind, a global module hook, a cache sink) runs the
eager kernel for that call, so patterns can be read and edited under every kernel while the other
layers keep the fast one. Likewise ``hook_result`` (per-head outputs, [B, P, H, D]) is computed only
when observed or ``options.use_attn_result`` is set (``Decoder.set_use_attn_result``).

Order of operations, each on its hook: projections (clamped to ``clip_qkv`` when set; q and k only after
their QK norm with ``clip_qkv_after_qk_norm``, as OLMoE) ->
``hook_q``/``hook_k``/``hook_v`` -> QK norm (``q_norm``/``k_norm``, per head or over the whole
projection, when ``qk_norm`` is set) -> RoPE (``hook_rot_q``/``hook_rot_k``; queries then scaled per
position with ``query_scale_beta``, on a layer without RoPE too; the QK norm comes here instead with
``qk_norm_after_rotary``) -> scores q.k /
attn_scale, soft-capped when ``attn_scores_soft_cap`` is set, plus mask (causal, windowed, or chunked with
``attention_chunk_size``) and ALiBi bias
(``hook_attn_scores``) -> ``hook_pattern`` -> ``hook_z`` -> output projection.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from workbench.components.attention_kernels import FAST_KERNELS, MaskSpec, eager_attention, identity_hook
from workbench.components.norm import make_norm
from workbench.components.rotary import Rotary, alibi_slopes
from workbench.components.zero_biases import ZeroBiases
from workbench.config import ModelConfig
from workbench.options import RuntimeOptions
from workbench.hook_point import HookPoint, is_observed


class AttentionBase(ZeroBiases, nn.Module):
    """What every attention variant shares: the kernel (``attend``), sinks, the output projection
    (``project_out``, ``W_O`` [H, J, D], ``b_O``: zeros when the model has none, as in TransformerLens)
    and the hooks on scores, pattern, z and results."""

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__()
        self.bias_shapes = {"b_O": (cfg.d_model,)}
        self.n_heads, self.d_head, self.d_head_v, self.d_model = cfg.n_heads, cfg.d_head, cfg.d_head_v, cfg.d_model
        self.scale, self.sliding_window = 1.0 / cfg.attn_scale, cfg.sliding_window
        self.soft_cap = cfg.attn_scores_soft_cap
        self.chunk_size = cfg.attention_chunk_size
        self.options = options  # the model's own: its kernel and use_attn_result switch here too
        if cfg.positional == "alibi":
            with torch.device("cpu"):  # real slopes even when the model is built on the meta device
                slopes_H = alibi_slopes(cfg.n_heads)
            self.register_buffer("alibi_slopes_H", slopes_H, persistent=False)
        else:
            self.alibi_slopes_H = None
        # A subclass makes _W_O_lin [D, H*J] and b_O [D] (or None), then calls _add_kernel_hooks.

    def _add_kernel_hooks(self, cfg: ModelConfig, options: RuntimeOptions) -> None:
        """Sinks and the hooks from the scores on, registered after the subclass's own (so a cache
        lists hooks in the order they fire)."""
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads, dtype=options.dtype)) if cfg.attn_sinks else None  # [H] logits
        self.hook_attn_scores = HookPoint()  # [B, H, P, S]
        self.hook_pattern = HookPoint()  # [B, H, P, S]
        self.hook_z = HookPoint()  # [B, P, H, J]
        self.hook_result = HookPoint()  # [B, P, H, D], computed only when hooked
        if cfg.attn_sinks:
            self.hook_sink_weight = HookPoint()  # [B, H, P]: each query's softmax mass on its head's sink

    def attend(self, q_BHPK: Tensor, k_BGSK: Tensor, v_BGSJ: Tensor, key_mask_BS: Optional[Tensor]) -> Tensor:
        """z [B, P, H, J] from queries and every key and value so far, on this layer's kernel (eager
        when a pattern hook needs the pattern materialised)."""
        mask = MaskSpec(scale=self.scale, q_offset=k_BGSK.shape[2] - q_BHPK.shape[2], sliding_window=self.sliding_window,
                        alibi_slopes_H=self.alibi_slopes_H, soft_cap=self.soft_cap, key_mask_BS=key_mask_BS,
                        sinks_H=self.sinks, chunk_size=self.chunk_size)
        fast_kernel = FAST_KERNELS.get(self.options.attn_impl)  # None for "eager"
        if fast_kernel is None or self.pattern_is_hooked():
            return eager_attention(q_BHPK, k_BGSK, v_BGSJ, mask, self.hook_attn_scores, self.pattern_hook,
                                   getattr(self, "hook_sink_weight", identity_hook))
        return fast_kernel(q_BHPK, k_BGSK, v_BGSJ, mask)

    def pattern_hook(self, pattern_BHPS: Tensor) -> Tensor:
        """What the eager kernel passes its pattern through: ``hook_pattern`` (differential attention adds its own)."""
        return self.hook_pattern(pattern_BHPS)

    def project_out(self, z_BPHJ: Float[Tensor, "batch pos n_heads d_head_v"]) -> Float[Tensor, "batch pos d_model"]:
        """The output projection, through per-head results (``hook_result``) when something needs them."""
        if self.options.use_attn_result or is_observed(self.hook_result):
            result_BPHD = self.hook_result(torch.einsum("bphk,hkd->bphd", z_BPHJ, self.W_O))
            out = result_BPHD.sum(dim=2)
            b_O = self.stored_bias("b_O")
            return out if b_O is None else out + b_O
        return F.linear(z_BPHJ.flatten(-2), self._W_O_lin, self.stored_bias("b_O"))

    def pattern_is_hooked(self) -> bool:
        """True when anything observes scores, pattern or sink weight (``workbench.hook_point.is_observed``),
        which then must be materialised (forces eager here)."""
        return any(is_observed(getattr(self, name)) for name in PATTERN_HOOKS if hasattr(self, name))

    @property
    def attn_impl(self) -> str:
        """The kernel this layer runs (the model's ``options.attn_impl``)."""
        return self.options.attn_impl

    @property
    def W_O(self) -> Float[Tensor, "n_heads d_head_v d_model"]:
        return self._W_O_lin.view(self.d_model, self.n_heads, self.d_head_v).permute(1, 2, 0)


class Attention(AttentionBase):
    """Causal self-attention (MHA / GQA / MQA) with optional RoPE, ALiBi, sliding window, QK norm,
    soft-capping and sinks; built from one layer's config (``ModelConfig.for_layer``)."""

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__(cfg, options)
        H, G, K, D = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model
        self.n_key_value_heads = G
        self.clip_qkv = cfg.clip_qkv
        self.clip_after_norm = cfg.clip_qkv_after_qk_norm and cfg.qk_norm is not None
        self._W_Q_lin = nn.Parameter(torch.empty(H * K, D, dtype=options.dtype))
        self._W_K_lin = nn.Parameter(torch.empty(G * K, D, dtype=options.dtype))
        self._W_V_lin = nn.Parameter(torch.empty(G * K, D, dtype=options.dtype))
        self._W_O_lin = nn.Parameter(torch.empty(D, H * K, dtype=options.dtype))
        if cfg.attn_bias:
            self._b_Q_lin = nn.Parameter(torch.zeros(H * K, dtype=options.dtype))
            self._b_K_lin = nn.Parameter(torch.zeros(G * K, dtype=options.dtype))
            self._b_V_lin = nn.Parameter(torch.zeros(G * K, dtype=options.dtype))
            self.b_O = nn.Parameter(torch.zeros(D, dtype=options.dtype))
        else:
            self._b_Q_lin = self._b_K_lin = self._b_V_lin = self.b_O = None
        # QK norm gains: [heads, d_head] per head, or [heads * d_head] over the whole projection.
        self.qk_norm_over_projection = cfg.qk_norm == "projection"
        self.qk_norm_after_rotary = cfg.qk_norm_after_rotary
        self.query_scale_beta, self.query_scale_length = cfg.query_scale_beta, cfg.query_scale_length
        self.query_scale_offset = cfg.query_scale_position_offset
        if cfg.qk_norm is not None:
            q_shape, k_shape = ((H * K,), (G * K,)) if self.qk_norm_over_projection else ((H, K), (G, K))
            self.q_norm, self.k_norm = make_norm(cfg, options, q_shape), make_norm(cfg, options, k_shape)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = Rotary(cfg) if cfg.positional == "rotary" else None

        self.hook_q = HookPoint()  # [B, P, H, K]
        self.hook_k = HookPoint()  # [B, P, G, K]; [B, P, H, K] with ungroup_grouped_query_attention
        self.hook_v = HookPoint()  # [B, P, G, K]; likewise
        self.hook_rot_q = HookPoint()  # [B, P, H, K]
        self.hook_rot_k = HookPoint()  # [B, P, G, K]; likewise
        self._add_kernel_hooks(cfg, options)

    def forward(
        self,
        x_BPD: Float[Tensor, "batch pos d_model"],
        positions: Int[Tensor, "*batch pos"],
        kv_cache: Optional["LayerKVCache"] = None,
        split_inputs: Optional[tuple[Tensor, Tensor, Tensor]] = None,
        key_mask_BS: Optional[Tensor] = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """``positions``: [P], or [B, P] when rows are padded (each row counts from its first real
        token). ``split_inputs``: per-head inputs (q [B, P, H, D], k and v [B, P, G, D]) that replace
        ``x_BPD`` (``use_split_qkv_input``); each head then reads its own copy. ``key_mask_BS``:
        True for real tokens over every key position (cached ones included), None when none is padding."""
        H, K = self.n_heads, self.d_head
        q_in, k_in, v_in = split_inputs if split_inputs is not None else (x_BPD, x_BPD, x_BPD)
        clip_qk = (lambda x: x) if self.clip_after_norm else self._clip
        q_BPHK = self.hook_q(clip_qk(_project(q_in, self._W_Q_lin, self._b_Q_lin, H, K)))
        # G below is n_kv_hooked: the model's key/value heads, or n_heads when ungrouped.
        k_BPGK = self.hook_k(clip_qk(self._project_kv(k_in, self._W_K_lin, self._b_K_lin)))
        v_BPGK = self.hook_v(self._clip(self._project_kv(v_in, self._W_V_lin, self._b_V_lin)))
        if self.q_norm is not None and not self.qk_norm_after_rotary:
            q_BPHK, k_BPGK = self._qk_normed(self.q_norm, q_BPHK), self._qk_normed(self.k_norm, k_BPGK)
        if self.clip_after_norm:  # OLMoE clamps the normed q and k
            q_BPHK, k_BPGK = self._clip(q_BPHK), self._clip(k_BPGK)
        if self.rotary is not None:
            q_BPHK = self.hook_rot_q(self._position_scaled(self.rotary(q_BPHK, positions), positions))
            k_BPGK = self.hook_rot_k(self.rotary(k_BPGK, positions))
        else:  # a layer without RoPE may still scale its queries by position (Llama 4's NoPE layers)
            q_BPHK = self._position_scaled(q_BPHK, positions)
        if self.q_norm is not None and self.qk_norm_after_rotary:  # HunYuan: the rotated q and k normed
            q_BPHK, k_BPGK = self._qk_normed(self.q_norm, q_BPHK), self._qk_normed(self.k_norm, k_BPGK)

        q_BHPK, k_BGSK, v_BGSK = q_BPHK.transpose(1, 2), k_BPGK.transpose(1, 2), v_BPGK.transpose(1, 2)
        if kv_cache is not None:
            k_BGSK, v_BGSK = kv_cache.append(k_BGSK, v_BGSK)
        # Under autograd with split inputs each query head's copy needs its own gradient (circuit edges per query
        # head), which the grouped kernel would sum over the group: the ungrouped heads run as they are.
        if self.n_kv_hooked != self.n_key_value_heads and not (split_inputs is not None and torch.is_grad_enabled()):
            k_BGSK, v_BGSK = _regrouped_if_copies(k_BGSK, v_BGSK, self.n_heads // self.n_key_value_heads)
        z_BPHK = self.hook_z(self.attend(q_BHPK, k_BGSK, v_BGSK, key_mask_BS))
        return self.project_out(z_BPHK)

    def _position_scaled(self, q_BPHK: Tensor, positions: Tensor) -> Tensor:
        """Queries times 1 + beta * log(1 + floor((position + offset) / length)) (``query_scale_beta``; Ministral 3,
        Llama 4's attention temperature with offset 1), or as they are."""
        if self.query_scale_beta is None:
            return q_BPHK
        shifted = positions.float() + self.query_scale_offset
        scale = 1 + self.query_scale_beta * torch.log(1 + torch.floor(shifted / self.query_scale_length))
        return q_BPHK * scale[..., None, None].to(q_BPHK.dtype)

    @property
    def n_kv_hooked(self) -> int:
        """How many key/value heads ``hook_k``/``hook_v`` (``hook_rot_k``, the split inputs, the KV cache) carry:
        ``n_heads`` under ``options.ungroup_grouped_query_attention`` (each query head its group's copy),
        else the model's ``n_key_value_heads``.

        Example:
            >>> model.blocks[0].attn.n_kv_hooked == model.cfg.n_key_value_heads
            True
        """
        return self.n_heads if self.options.ungroup_grouped_query_attention else self.n_key_value_heads

    def _project_kv(self, x: Tensor, W_lin: Tensor, b_lin: Optional[Tensor]) -> Tensor:
        """Keys or values [B, P, n_kv_hooked, K]: the grouped projection, repeated per query head when ungrouped
        (per-head inputs [B, P, H, D] then go through their query head's copy of the group's weights)."""
        H, G, K = self.n_heads, self.n_key_value_heads, self.d_head
        if self.n_kv_hooked == G:
            return _project(x, W_lin, b_lin, G, K)
        g = H // G
        if x.ndim == 3:  # one GEMM over the key/value heads, then each group's result copied to its query heads
            return _project(x, W_lin, b_lin, G, K).repeat_interleave(g, dim=2)
        W_per_head = W_lin.view(G, K, -1).repeat_interleave(g, dim=0).flatten(0, 1)
        b_per_head = None if b_lin is None else b_lin.view(G, K).repeat_interleave(g, dim=0).flatten()
        return _project(x, W_per_head, b_per_head, H, K)

    def _clip(self, x: Tensor) -> Tensor:
        return x if self.clip_qkv is None else x.clamp(-self.clip_qkv, self.clip_qkv)

    def _qk_normed(self, norm: nn.Module, x_BPnK: Tensor) -> Tensor:
        """Per head (over d_head), or over the whole projection (heads * d_head) and back. Ungrouped keys
        [B, P, H, K] meet the key heads' gains [G, K] with each group's copies side by side."""
        if self.qk_norm_over_projection:
            return norm(x_BPnK.flatten(-2)).view(x_BPnK.shape)
        gains_heads = norm.w.shape[0]
        if x_BPnK.shape[-2] == gains_heads:
            return norm(x_BPnK)
        B, P, n, K = x_BPnK.shape  # ungrouped: head h is group h // g
        x_BPgGK = x_BPnK.view(B, P, gains_heads, n // gains_heads, K).transpose(2, 3)
        return norm(x_BPgGK).transpose(2, 3).reshape(B, P, n, K)

    # ---- TransformerLens's names: views of the nn.Linear-layout storage ------------------------
    @property
    def W_Q(self) -> Float[Tensor, "n_heads d_model d_head"]:
        return self._W_Q_lin.view(self.n_heads, self.d_head, self.d_model).transpose(1, 2)

    @property
    def _W_K(self) -> Float[Tensor, "n_key_value_heads d_model d_head"]:
        return self._W_K_lin.view(self.n_key_value_heads, self.d_head, self.d_model).transpose(1, 2)

    @property
    def _W_V(self) -> Float[Tensor, "n_key_value_heads d_model d_head"]:
        return self._W_V_lin.view(self.n_key_value_heads, self.d_head, self.d_model).transpose(1, 2)

    @property
    def W_K(self) -> Float[Tensor, "n_heads d_model d_head"]:
        """Per query head: a GQA key head repeated for each query head of its group (a copy then)."""
        return self._per_query_head(self._W_K)

    @property
    def W_V(self) -> Float[Tensor, "n_heads d_model d_head"]:
        return self._per_query_head(self._W_V)

    @property
    def b_Q(self) -> Float[Tensor, "n_heads d_head"]:
        """[H, K]; zeros when the model has no attention biases (as in TransformerLens)."""
        return self._bias_view(self._b_Q_lin, self.n_heads)

    @property
    def _b_K(self) -> Float[Tensor, "n_key_value_heads d_head"]:
        return self._bias_view(self._b_K_lin, self.n_key_value_heads)

    @property
    def _b_V(self) -> Float[Tensor, "n_key_value_heads d_head"]:
        return self._bias_view(self._b_V_lin, self.n_key_value_heads)

    @property
    def b_K(self) -> Float[Tensor, "n_heads d_head"]:
        return self._per_query_head(self._b_K)

    @property
    def b_V(self) -> Float[Tensor, "n_heads d_head"]:
        return self._per_query_head(self._b_V)

    def _bias_view(self, b_lin: Optional[Tensor], n: int) -> Tensor:
        """A stored bias [n * K] as [n, K] (a view: writing it writes the bias), or zeros when absent."""
        if b_lin is None:
            return torch.zeros(n, self.d_head, dtype=self._W_Q_lin.dtype, device=self._W_Q_lin.device)
        return b_lin.view(n, self.d_head)

    def _per_query_head(self, kv_G: Tensor) -> Tensor:
        groups = self.n_heads // self.n_key_value_heads
        return kv_G if groups == 1 else kv_G.repeat_interleave(groups, dim=0)


def _project(x: Tensor, W_lin: Tensor, b_lin: Optional[Tensor], n: int, K: int) -> Tensor:
    """[B, P, D] through one GEMM (the usual path), or per-head inputs [B, P, n, D], each head
    through its own [D, K] slice -> [B, P, n, K]."""
    if x.ndim == 3:
        return F.linear(x, W_lin, b_lin).view(*x.shape[:2], n, K)
    out = torch.einsum("bpnd,ndk->bpnk", x, W_lin.view(n, K, -1).transpose(1, 2))
    return out if b_lin is None else out + b_lin.view(n, K)


def _regrouped_if_copies(k_BnSK: Tensor, v_BnSK: Tensor, g: int) -> tuple[Tensor, Tensor]:
    """Ungrouped keys and values [B, H, S, K] back to their groups [B, G, S, K] when every query head still
    holds its group's copy (nothing edited one head apart), so the kernel runs the grouped computation and the
    logits are exactly the grouped model's; otherwise as they are (each query head its own key/value head)."""
    k_grouped, v_grouped = k_BnSK[:, ::g], v_BnSK[:, ::g]
    if all(torch.equal(grouped.repeat_interleave(g, dim=1), full)
           for grouped, full in ((k_grouped, k_BnSK), (v_grouped, v_BnSK))):
        return k_grouped, v_grouped
    return k_BnSK, v_BnSK


PATTERN_HOOKS = ("hook_attn_scores", "hook_pattern", "hook_sink_weight", "hook_pattern_1", "hook_pattern_2")


class LayerKVCache:
    """Keys and values (after RoPE) of one layer for all positions seen so far: [B, G, S, K]; for latent
    attention the latent [B, 1, S, kv_lora_rank] and the shared rotary key [B, 1, S, rotary_dim] instead.

    The positions live in buffers with room for more (a quarter more, at least ``SPARE_POSITIONS``), so a
    decoding step writes only its own keys and values: a cache grown by ``torch.cat`` copies all of itself every
    step (SmolLM2 generating 128 tokens at batch 8 took 0.90x the time this way). Under autograd each call gets
    buffers of its own, since the graph keeps the ones an earlier call returned.

    Example:
        >>> cache = LayerKVCache()
        >>> k, v = cache.append(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))   # 3 positions
        >>> k, v = cache.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))  # and 1 more
        >>> cache.length, k.shape, k[0, 0, :, 0].tolist()
        (4, torch.Size([1, 2, 4, 4]), [1.0, 1.0, 1.0, 0.0])
    """

    SPARE_POSITIONS = 64

    def __init__(self) -> None:
        self._k: Optional[Tensor] = None
        self._v: Optional[Tensor] = None
        self.length = 0

    @property
    def k_BGSK(self) -> Optional[Tensor]:
        return None if self._k is None else self._k[:, :, :self.length]

    @property
    def v_BGSK(self) -> Optional[Tensor]:
        return None if self._v is None else self._v[:, :, :self.length]

    def append(self, k_BGPK: Tensor, v_BGPK: Tensor) -> tuple[Tensor, Tensor]:
        """Adds the new positions and returns keys/values for every position so far."""
        n, total = self.length, self.length + k_BGPK.shape[2]
        in_graph = torch.is_grad_enabled() and (k_BGPK.requires_grad or v_BGPK.requires_grad)
        if self._k is None or total > self._k.shape[2] or in_graph:
            capacity = total if in_graph else total + max(self.SPARE_POSITIONS, total // 4)
            self._k, self._v = (_with_room(old, new, n, capacity) for old, new in ((self._k, k_BGPK), (self._v, v_BGPK)))
        self._k[:, :, n:total].copy_(k_BGPK)
        self._v[:, :, n:total].copy_(v_BGPK)
        self.length = total
        return self.k_BGSK, self.v_BGSK


def _with_room(cached: Optional[Tensor], new: Tensor, n: int, capacity: int) -> Tensor:
    """A [B, G, capacity, K] buffer shaped like ``new`` holding the first ``n`` positions of ``cached``."""
    buffer = new.new_empty(*new.shape[:2], capacity, new.shape[3])
    if n:
        buffer[:, :, :n].copy_(cached[:, :, :n])
    return buffer
