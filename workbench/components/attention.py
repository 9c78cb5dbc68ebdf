"""Multi-head, grouped-query and multi-query causal self-attention with TransformerLens hooks.

Legend: B batch, P position, H n_heads, G n_key_value_heads, K d_head, D d_model, S key position.

Weights follow `torch.nn.Linear`'s layout so the projections are the same matmuls
`transformers` runs: ``W_Q`` [H*K, D], ``W_K``/``W_V`` [G*K, D], ``W_O`` [D, H*K]; biases
``b_Q`` [H*K], ``b_K``/``b_V`` [G*K], ``b_O`` [D] exist when ``cfg.attn_bias``.
TransformerLens's per-head views ([H, D, K] and [H, K, D]) are the ``*_heads`` properties.

The kernel is swappable (``attn_impl``, set from the config and switched by
``Decoder.set_attn_impl``). The module keeps the few config values it needs as plain attributes,
never a copy of the config that ``.to()`` or a kernel switch would leave stale. A layer whose ``hook_attn_scores`` or
``hook_pattern`` has a hook attached runs the eager kernel for that call, so patterns can be
read and edited under every kernel while the other layers keep the fast one. Likewise
``hook_result`` (per-head outputs, [B, P, H, D]) is computed only when something hooks it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from workbench.components.attention_kernels import FAST_KERNELS, MaskSpec, eager_attention
from workbench.components.rotary import Rotary, alibi_slopes
from workbench.config import ModelConfig


class Attention(nn.Module):
    """Causal self-attention (MHA / GQA / MQA) with optional RoPE, ALiBi and sliding window."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, G, K, D = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model
        self.n_heads, self.n_key_value_heads, self.d_head, self.d_model = H, G, K, D
        self.scale, self.sliding_window = cfg.attn_scale, cfg.sliding_window
        self.attn_impl = cfg.attn_impl
        self.W_Q = nn.Parameter(torch.empty(H * K, D, dtype=cfg.dtype))
        self.W_K = nn.Parameter(torch.empty(G * K, D, dtype=cfg.dtype))
        self.W_V = nn.Parameter(torch.empty(G * K, D, dtype=cfg.dtype))
        self.W_O = nn.Parameter(torch.empty(D, H * K, dtype=cfg.dtype))
        if cfg.attn_bias:
            self.b_Q = nn.Parameter(torch.zeros(H * K, dtype=cfg.dtype))
            self.b_K = nn.Parameter(torch.zeros(G * K, dtype=cfg.dtype))
            self.b_V = nn.Parameter(torch.zeros(G * K, dtype=cfg.dtype))
            self.b_O = nn.Parameter(torch.zeros(D, dtype=cfg.dtype))
        else:
            self.b_Q = self.b_K = self.b_V = self.b_O = None
        self.rotary = Rotary(cfg) if cfg.positional == "rotary" else None
        if cfg.positional == "alibi":
            self.register_buffer("alibi_slopes_H", alibi_slopes(H), persistent=False)
        else:
            self.alibi_slopes_H = None

        self.hook_q = HookPoint()  # [B, P, H, K]
        self.hook_k = HookPoint()  # [B, P, G, K]
        self.hook_v = HookPoint()  # [B, P, G, K]
        self.hook_rot_q = HookPoint()  # [B, P, H, K]
        self.hook_rot_k = HookPoint()  # [B, P, G, K]
        self.hook_attn_scores = HookPoint()  # [B, H, P, S]
        self.hook_pattern = HookPoint()  # [B, H, P, S]
        self.hook_z = HookPoint()  # [B, P, H, K]
        self.hook_result = HookPoint()  # [B, P, H, D], computed only when hooked

    def forward(
        self,
        x_BPD: Float[Tensor, "batch pos d_model"],
        positions_P: Int[Tensor, "pos"],
        kv_cache: Optional["LayerKVCache"] = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        B, P, _ = x_BPD.shape
        H, G, K = self.n_heads, self.n_key_value_heads, self.d_head
        q_BPHK = self.hook_q(F.linear(x_BPD, self.W_Q, self.b_Q).view(B, P, H, K))
        k_BPGK = self.hook_k(F.linear(x_BPD, self.W_K, self.b_K).view(B, P, G, K))
        v_BPGK = self.hook_v(F.linear(x_BPD, self.W_V, self.b_V).view(B, P, G, K))
        if self.rotary is not None:
            q_BPHK = self.hook_rot_q(self.rotary(q_BPHK, positions_P))
            k_BPGK = self.hook_rot_k(self.rotary(k_BPGK, positions_P))

        q_BHPK, k_BGSK, v_BGSK = q_BPHK.transpose(1, 2), k_BPGK.transpose(1, 2), v_BPGK.transpose(1, 2)
        if kv_cache is not None:
            k_BGSK, v_BGSK = kv_cache.append(k_BGSK, v_BGSK)
        mask = MaskSpec(scale=self.scale, q_offset=k_BGSK.shape[2] - P,
                        sliding_window=self.sliding_window, alibi_slopes_H=self.alibi_slopes_H)

        fast_kernel = FAST_KERNELS.get(self.attn_impl)  # None for "eager"
        if fast_kernel is None or self.pattern_is_hooked():
            z_BPHK = eager_attention(q_BHPK, k_BGSK, v_BGSK, mask, self.hook_attn_scores, self.hook_pattern)
        else:
            z_BPHK = fast_kernel(q_BHPK, k_BGSK, v_BGSK, mask)
        z_BPHK = self.hook_z(z_BPHK)

        if _is_hooked(self.hook_result):
            W_O_HKD = self.W_O_heads
            result_BPHD = self.hook_result(torch.einsum("bphk,hkd->bphd", z_BPHK, W_O_HKD))
            out = result_BPHD.sum(dim=2)
            return out if self.b_O is None else out + self.b_O
        return F.linear(z_BPHK.reshape(B, P, H * K), self.W_O, self.b_O)

    def pattern_is_hooked(self) -> bool:
        """True when a hook on scores or pattern needs them materialised (forces eager here)."""
        return _is_hooked(self.hook_attn_scores) or _is_hooked(self.hook_pattern)

    # ---- TransformerLens-layout views, for composition scores and attribution -----------------
    @property
    def W_Q_heads(self) -> Float[Tensor, "n_heads d_model d_head"]:
        return self.W_Q.view(self.n_heads, self.d_head, self.d_model).transpose(1, 2)

    @property
    def W_K_heads(self) -> Float[Tensor, "n_heads d_model d_head"]:
        """Per *query* head (a K/V head is shared by its group, as TransformerLens's GQA view)."""
        kv = self.W_K.view(self.n_key_value_heads, self.d_head, self.d_model).transpose(1, 2)
        return kv.repeat_interleave(self.n_heads // self.n_key_value_heads, dim=0)

    @property
    def W_V_heads(self) -> Float[Tensor, "n_heads d_model d_head"]:
        kv = self.W_V.view(self.n_key_value_heads, self.d_head, self.d_model).transpose(1, 2)
        return kv.repeat_interleave(self.n_heads // self.n_key_value_heads, dim=0)

    @property
    def W_O_heads(self) -> Float[Tensor, "n_heads d_head d_model"]:
        return self.W_O.view(self.d_model, self.n_heads, self.d_head).permute(1, 2, 0)


def _is_hooked(hook_point: HookPoint) -> bool:
    # Forward hooks (TransformerLens fwd hooks, run_with_cache) and backward hooks both register
    # on the module, so this sees every way a user can attach to the point.
    return bool(hook_point._forward_hooks or hook_point._backward_hooks)


class LayerKVCache:
    """Keys and values (after RoPE) of one layer for all positions seen so far: [B, G, S, K]."""

    def __init__(self) -> None:
        self.k_BGSK: Optional[Tensor] = None
        self.v_BGSK: Optional[Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.k_BGSK is None else self.k_BGSK.shape[2]

    def append(self, k_BGPK: Tensor, v_BGPK: Tensor) -> tuple[Tensor, Tensor]:
        """Adds the new positions and returns keys/values for every position so far."""
        if self.k_BGSK is None:
            self.k_BGSK, self.v_BGSK = k_BGPK, v_BGPK
        else:
            self.k_BGSK = torch.cat([self.k_BGSK, k_BGPK], dim=2)
            self.v_BGSK = torch.cat([self.v_BGSK, v_BGPK], dim=2)
        return self.k_BGSK, self.v_BGSK
