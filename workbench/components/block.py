"""One transformer block: attention and an MLP (dense or mixture of experts) on the residual stream.

Legend: B batch, P position, D d_model.

Pre-norm (GPT-2, Llama): x + attn(ln1(x)), then + mlp(ln2(.)).
Post-norm (the original transformer): ln1(x + attn(x)), then ln2(. + mlp(.)).
With ``use_split_qkv_input`` (TransformerLens's switch, pre-norm only) each query head and each
key/value head reads its own copy of the residual stream (``hook_q_input`` [B, P, H, D],
``hook_k_input``/``hook_v_input`` [B, P, G, D]), normed by ln1, so one head's input can be patched.
"""

from __future__ import annotations

from typing import Optional

from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from workbench.components.attention import Attention, LayerKVCache
from workbench.components.mlp import MLP, GatedMLP
from workbench.components.moe import MixtureOfExperts
from workbench.components.norm import make_norm
from workbench.config import ModelConfig


def make_mlp(cfg: ModelConfig) -> nn.Module:
    """The block's feed-forward layer as the config describes it."""
    if cfg.is_moe:
        return MixtureOfExperts(cfg)
    return GatedMLP(cfg) if cfg.gated_mlp else MLP(cfg)


class TransformerBlock(nn.Module):
    """Maps the residual stream [B, P, D] to itself."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.use_split_qkv_input = cfg.use_split_qkv_input
        self.ln1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.hook_resid_pre = HookPoint()  # [B, P, D]
        self.hook_q_input = HookPoint()  # [B, P, H, D], only with use_split_qkv_input
        self.hook_k_input = HookPoint()  # [B, P, G, D]
        self.hook_v_input = HookPoint()  # [B, P, G, D]
        self.hook_attn_out = HookPoint()  # [B, P, D]
        self.hook_resid_post = HookPoint()  # [B, P, D]
        self.has_mlp = not cfg.attn_only
        if self.has_mlp:
            self.ln2 = make_norm(cfg)
            self.mlp = make_mlp(cfg)
            self.hook_resid_mid = HookPoint()  # [B, P, D]
            self.hook_mlp_out = HookPoint()  # [B, P, D]

    def forward(
        self,
        resid_BPD: Float[Tensor, "batch pos d_model"],
        positions_P: Int[Tensor, "pos"],
        kv_cache: Optional[LayerKVCache] = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid_BPD)
        if self.use_split_qkv_input:
            heads = (self.attn.n_heads, self.attn.n_key_value_heads, self.attn.n_key_value_heads)
            split = tuple(self.ln1(hook(resid[:, :, None].repeat(1, 1, n, 1)))  # a copy per head
                          for hook, n in zip((self.hook_q_input, self.hook_k_input, self.hook_v_input), heads))
            resid = resid + self.hook_attn_out(self.attn(resid, positions_P, kv_cache, split_inputs=split))
        elif self.pre_norm:
            resid = resid + self.hook_attn_out(self.attn(self.ln1(resid), positions_P, kv_cache))
        else:
            resid = self.ln1(resid + self.hook_attn_out(self.attn(resid, positions_P, kv_cache)))
        if not self.has_mlp:
            return self.hook_resid_post(resid)
        resid = self.hook_resid_mid(resid)
        if self.pre_norm:
            resid = resid + self.hook_mlp_out(self.mlp(self.ln2(resid)))
        else:
            resid = self.ln2(resid + self.hook_mlp_out(self.mlp(resid)))
        return self.hook_resid_post(resid)
