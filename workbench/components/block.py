"""One transformer block: attention and an MLP (dense or mixture of experts) on the residual stream.

Legend: B batch, P position, D d_model.

Where the norms sit (``norm_placement``; f is attention, then the MLP; ln is ln1, then ln2):
    pre:             x + f(ln(x))                          GPT-2, Llama and most others
    post:            ln(x + f(x))                          the original transformer, OPT-350m
    sandwich:        x + ln_post(f(ln(x)))                 Gemma 2 and 3 (ln1_post, ln2_post)
    sublayer_output: x + ln_post(f(x))                     OLMo 2
With ``parallel_attn_mlp`` (GPT-J, GPT-NeoX, Phi-1/2) both read the block input:
x + attn(ln1(x)) + mlp(ln2(x)), and there is no ``hook_resid_mid``.
With ``use_split_qkv_input`` (TransformerLens's switch, pre-norm only) each query head and each
key/value head reads its own copy of the residual stream (``hook_q_input`` [B, P, H, D],
``hook_k_input``/``hook_v_input`` [B, P, G, D]), normed by ln1, so one head's input can be patched.
``hook_mlp_in`` (TransformerLens's name) is the MLP's own copy of its input before its norm, computed only
when observed or with ``use_hook_mlp_in`` (TransformerLens's switch): an edit there reaches the MLP and not
the residual stream (circuit edges into the MLP).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from workbench.components.attention import Attention, LayerKVCache
from workbench.components.differential_attention import DifferentialAttention
from workbench.components.latent_attention import LatentAttention
from workbench.components.mlp import MLP, GatedMLP
from workbench.components.moe import MixtureOfExperts
from workbench.components.norm import make_norm
from workbench.config import ModelConfig
from workbench.options import RuntimeOptions
from workbench.hook_point import HookPoint, has_forward_hooks, is_observed


def make_mlp(cfg: ModelConfig, options: RuntimeOptions) -> nn.Module:
    """The block's feed-forward layer as the config describes it.

    Example:
        >>> type(make_mlp(model.cfg.replace(attn_only=False, d_mlp=256), model.options)).__name__
        'MLP'
        >>> type(make_mlp(model.cfg.replace(attn_only=False, d_mlp=256, gated_mlp=True), model.options)).__name__
        'GatedMLP'
    """
    if cfg.is_moe:
        return MixtureOfExperts(cfg, options)
    return GatedMLP(cfg, options) if cfg.gated_mlp else MLP(cfg, options)


def make_attention(cfg: ModelConfig, options: RuntimeOptions) -> nn.Module:
    """The block's attention as the config describes it: latent (``kv_lora_rank`` set), differential
    (``differential_lambda_init`` set) or standard.

    Example:
        >>> type(make_attention(model.cfg, model.options)).__name__
        'Attention'
    """
    if cfg.is_latent_attention:
        return LatentAttention(cfg, options)
    return DifferentialAttention(cfg, options) if cfg.differential_lambda_init is not None else Attention(cfg, options)


def _identity(x: Tensor) -> Tensor:
    return x


class TransformerBlock(nn.Module):
    """Maps the residual stream [B, P, D] to itself; built from one layer's config (``cfg.for_layer``)."""

    # TransformerLens 4.3's analysis tools (logit_lens, DLA) read this flag off each block: our
    # hook_resid_post is the one residual stream the next block (or ln_final) reads.
    hook_out_is_single_residual_stream = True

    def __init__(self, cfg: ModelConfig, options: RuntimeOptions):
        super().__init__()
        self.norm_placement = cfg.norm_placement
        self.parallel = cfg.parallel_attn_mlp
        self.options = options  # the model's own: its use_split_qkv_input and use_hook_mlp_in switches here too
        sublayer_output = cfg.norm_placement == "sublayer_output"
        post_norms = cfg.norm_placement in ("sandwich", "sublayer_output")
        self.ln1 = None if sublayer_output else make_norm(cfg, options)
        self.ln1_post = make_norm(cfg, options) if post_norms else None
        self.attn = make_attention(cfg, options)
        self.hook_resid_pre = HookPoint()  # [B, P, D]
        self.hook_q_input = HookPoint()  # [B, P, H, D], only with use_split_qkv_input
        self.hook_k_input = HookPoint()  # [B, P, G, D]
        self.hook_v_input = HookPoint()  # [B, P, G, D]
        self.hook_attn_out = HookPoint()  # [B, P, D]
        self.hook_resid_post = HookPoint()  # [B, P, D]
        self.has_mlp = not cfg.attn_only
        if self.has_mlp:
            self.ln2 = None if sublayer_output else make_norm(cfg, options)
            self.ln2_post = make_norm(cfg, options) if post_norms else None
            self.mlp = make_mlp(cfg, options)
            self.hook_mlp_in = HookPoint()  # [B, P, D], the MLP's own copy of its input; observed or use_hook_mlp_in
            if not self.parallel:
                self.hook_resid_mid = HookPoint()  # [B, P, D]
            self.hook_mlp_out = HookPoint()  # [B, P, D]

    def forward(
        self,
        resid_BPD: Float[Tensor, "batch pos d_model"],
        positions: Int[Tensor, "*batch pos"],
        kv_cache: Optional[LayerKVCache] = None,
        key_mask_BS: Optional[Tensor] = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid_BPD)
        if self.options.use_split_qkv_input:
            heads = (self.attn.n_heads, self.attn.n_kv_hooked, self.attn.n_kv_hooked)  # per query head if ungrouped
            split = tuple(self.ln1(hook(resid[:, :, None].repeat(1, 1, n, 1)))  # a copy per head
                          for hook, n in zip((self.hook_q_input, self.hook_k_input, self.hook_v_input), heads))
            attn_out = self.hook_attn_out(self.attn(resid, positions, kv_cache, split_inputs=split,
                                                    key_mask_BS=key_mask_BS))
            resid_mid = resid + attn_out
        else:
            attend = lambda x: self.attn(x, positions, kv_cache, key_mask_BS=key_mask_BS)  # noqa: E731
            resid_mid = self._sublayer(resid, attend, self.ln1, self.ln1_post, self.hook_attn_out, self.attn)
        if not self.has_mlp:
            return self.hook_resid_post(resid_mid)
        ln2, mlp = self._mlp_side()
        if self.parallel:  # the MLP reads the block input too
            return self.hook_resid_post(resid_mid + self.hook_mlp_out(mlp(ln2(resid))))
        resid_mid = self.hook_resid_mid(resid_mid)
        resid_post = self._sublayer(resid_mid, mlp, ln2, self.ln2_post, self.hook_mlp_out, self.mlp)
        return self.hook_resid_post(resid_post)

    def _mlp_side(self) -> tuple[Optional[Callable[[Tensor], Tensor]], Callable[[Tensor], Tensor]]:
        """(the norm in front of the MLP, the MLP), with ``hook_mlp_in`` on a copy of the MLP's input before its
        norm when observed or switched on (the fast path is unchanged): post-norm blocks have no norm there, so it
        goes in front of the MLP itself."""
        if not (self.options.use_hook_mlp_in or is_observed(self.hook_mlp_in)):
            return self.ln2, self.mlp
        hooked = lambda x: self.hook_mlp_in(x.clone())  # noqa: E731  (a copy: an edit stays out of the residual)
        if self.norm_placement == "post":
            return self.ln2, lambda x: self.mlp(hooked(x))
        return (lambda x: (self.ln2 or _identity)(hooked(x))), self.mlp

    def _sublayer(self, resid: Tensor, f: Callable[[Tensor], Tensor], ln: Optional[nn.Module],
                  ln_post: Optional[nn.Module], hook_out: HookPoint, sublayer: nn.Module) -> Tensor:
        """The new residual for this block's norm placement; ``sublayer`` is the module ``f`` runs."""
        if self.norm_placement == "post":
            return ln(resid + hook_out(f(resid)))
        out = hook_out((ln_post or _identity)(f((ln or _identity)(resid))))
        if torch.is_grad_enabled() or is_observed(hook_out) or has_forward_hooks(sublayer, ln_post):
            return resid + out
        return out.add_(resid)  # a new tensor the sublayer made, read by nothing else: one allocation fewer
