"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values expanded per head from a cached latent.

Legend: B batch, P position, S key position, H n_heads, D d_model, K d_head, R rotary_dim, J d_head_v,
A kv_lora_rank, Q q_lora_rank, U d_head - rotary_dim.

K is the query/key width per head: U dimensions without RoPE, then R with it.

    queries   q = W_QB norm(W_QA x)  (or W_Q x without q_lora_rank), per head [U | R]; RoPE on the R part
    latent    [c | k_rope] = W_KVA x;  c = norm(c)                   [A], cached
    rope key  k_rope with RoPE: one [R] key shared by every head      cached
    per head  [k_nope | v] = W_KVB c;  k = [k_nope | k_rope]          recomputed from the cache each call

The KV cache (``LayerKVCache``) holds only the latent [B, 1, S, A] and the rotary key [B, 1, S, R],
which is what makes MLA's cache small. The two norms are RMSNorms with ``latent_norm_eps``. Parameters
in nn.Linear layout: ``_W_QA_lin`` [Q, D] (``_b_QA_lin`` with ``attn_bias``), ``q_a_norm``,
``_W_QB_lin`` [H*K, Q] (or ``_W_Q_lin`` [H*K, D]), ``_W_KVA_lin`` [A + R, D] (``_b_KVA_lin``),
``kv_a_norm``, ``_W_KVB_lin`` [H*(U+J), A], and the shared output projection ``W_O`` [H, J, D].

Hooks, in order: ``hook_q_latent`` [B, P, Q] (with q_lora_rank), ``hook_q`` [B, P, H, K] (before RoPE),
``hook_rot_q`` [B, P, H, K], ``hook_kv_latent`` [B, P, A] (normed: what is cached; editing it changes
every head's keys and values), ``hook_k_rope`` [B, P, R] (the shared key after RoPE), then ``hook_k``
[B, S, H, K] and ``hook_v`` [B, S, H, J] over every key position (cached ones included, as they are
re-expanded from the latent on each call), ``hook_attn_scores``, ``hook_pattern``, ``hook_z``
[B, P, H, J], ``hook_result``. There is no ``hook_rot_k``: RoPE acts on the shared key before the
per-head keys exist, so ``hook_k`` already holds rotated keys.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from workbench.components.attention import AttentionBase, LayerKVCache
from workbench.components.norm import RMSNorm
from workbench.components.rotary import Rotary
from workbench.config import ModelConfig
from workbench.options import RuntimeOptions
from workbench.hook_point import HookPoint


class LatentAttention(AttentionBase):
    """DeepSeek's multi-head latent attention; built from one layer's config (``ModelConfig.for_layer``)."""

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__(cfg, options)
        H, K, R, J, D = cfg.n_heads, cfg.d_head, cfg.rotary_dim, cfg.d_head_v, cfg.d_model
        A, Q = cfg.latent.kv_lora_rank, cfg.latent.q_lora_rank
        self.n_key_value_heads = H  # every head has its own key and value (expanded from the latent)
        self.d_nope, self.rotary_dim, self.kv_lora_rank = K - R, R, A
        latent_norm_cfg = cfg.replace(normalization="RMS", norm_eps=cfg.latent.latent_norm_eps)
        bias = (lambda n: nn.Parameter(torch.zeros(n, dtype=options.dtype))) if cfg.attn_bias else (lambda n: None)
        if Q is None:
            self._W_Q_lin = nn.Parameter(torch.empty(H * K, D, dtype=options.dtype))
            self._W_QA_lin = self._b_QA_lin = self.q_a_norm = self._W_QB_lin = None
        else:
            self._W_Q_lin = None
            self._W_QA_lin = nn.Parameter(torch.empty(Q, D, dtype=options.dtype))
            self._b_QA_lin = bias(Q)
            self.q_a_norm = RMSNorm(latent_norm_cfg, options, (Q,))
            self._W_QB_lin = nn.Parameter(torch.empty(H * K, Q, dtype=options.dtype))
        self._W_KVA_lin = nn.Parameter(torch.empty(A + R, D, dtype=options.dtype))
        self._b_KVA_lin = bias(A + R)
        self.kv_a_norm = RMSNorm(latent_norm_cfg, options, (A,))
        self._W_KVB_lin = nn.Parameter(torch.empty(H * (K - R + J), A, dtype=options.dtype))
        self._W_O_lin = nn.Parameter(torch.empty(D, H * J, dtype=options.dtype))
        self.b_O = nn.Parameter(torch.zeros(D, dtype=options.dtype)) if cfg.attn_bias else None
        self.rotary = Rotary(cfg)

        if Q is not None:
            self.hook_q_latent = HookPoint()  # [B, P, Q]
        self.hook_q = HookPoint()  # [B, P, H, K]
        self.hook_rot_q = HookPoint()  # [B, P, H, K]
        self.hook_kv_latent = HookPoint()  # [B, P, A]
        self.hook_k_rope = HookPoint()  # [B, P, R]
        self.hook_k = HookPoint()  # [B, S, H, K]
        self.hook_v = HookPoint()  # [B, S, H, J]
        self._add_kernel_hooks(cfg, options)

    def forward(
        self,
        x_BPD: Float[Tensor, "batch pos d_model"],
        positions: Int[Tensor, "*batch pos"],
        kv_cache: Optional[LayerKVCache] = None,
        key_mask_BS: Optional[Tensor] = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """As ``Attention.forward`` (``positions`` [P] or [B, P]; ``key_mask_BS`` over every key so far)."""
        B, P, _ = x_BPD.shape
        H, K, R = self.n_heads, self.d_head, self.rotary_dim
        if self._W_Q_lin is not None:
            q_flat = F.linear(x_BPD, self._W_Q_lin)
        else:
            q_latent_BPQ = self.hook_q_latent(self.q_a_norm(F.linear(x_BPD, self._W_QA_lin, self._b_QA_lin)))
            q_flat = F.linear(q_latent_BPQ, self._W_QB_lin)
        q_BPHK = self.hook_q(q_flat.view(B, P, H, K))
        q_BPHK = self.hook_rot_q(torch.cat([q_BPHK[..., :K - R], self.rotary(q_BPHK[..., K - R:], positions)], dim=-1))

        latent_BPA, k_rope_BPR = F.linear(x_BPD, self._W_KVA_lin, self._b_KVA_lin).split(
            [self.kv_lora_rank, R], dim=-1)
        latent_BPA = self.hook_kv_latent(self.kv_a_norm(latent_BPA))
        k_rope_BPR = self.hook_k_rope(self.rotary(k_rope_BPR[:, :, None], positions)[:, :, 0])
        latent_B1SA, k_rope_B1SR = latent_BPA[:, None], k_rope_BPR[:, None]
        if kv_cache is not None:
            latent_B1SA, k_rope_B1SR = kv_cache.append(latent_B1SA, k_rope_B1SR)
        k_BSHK, v_BSHJ = self.expand(latent_B1SA[:, 0], k_rope_B1SR[:, 0])
        k_BSHK, v_BSHJ = self.hook_k(k_BSHK), self.hook_v(v_BSHJ)
        z_BPHJ = self.hook_z(self.attend(q_BPHK.transpose(1, 2), k_BSHK.transpose(1, 2), v_BSHJ.transpose(1, 2),
                                         key_mask_BS))
        return self.project_out(z_BPHJ)

    def expand(self, latent_BSA: Float[Tensor, "batch key_pos kv_lora_rank"],
               k_rope_BSR: Float[Tensor, "batch key_pos rotary_dim"]
               ) -> tuple[Float[Tensor, "batch key_pos n_heads d_head"], Float[Tensor, "batch key_pos n_heads d_head_v"]]:
        """Every head's keys and values from the latent and the shared rotary key.

        Example:
            >>> k, v = attn.expand(cache["blocks.0.attn.hook_kv_latent"], cache["blocks.0.attn.hook_k_rope"])   # doctest: +SKIP
        """
        B, S, _ = latent_BSA.shape
        H, U = self.n_heads, self.d_nope
        kv_BSHx = F.linear(latent_BSA, self._W_KVB_lin).view(B, S, H, U + self.d_head_v)
        k_nope_BSHU, v_BSHJ = kv_BSHx.split([U, self.d_head_v], dim=-1)
        k_BSHK = torch.cat([k_nope_BSHU, k_rope_BSR[:, :, None].expand(B, S, H, self.rotary_dim)], dim=-1)
        return k_BSHK, v_BSHJ
