"""The one forward pass of ``experiments.flow`` and the split of each layer's attention output into the parts it
sums (by source, head and a constant), as it joins the residual stream: the model-facing half of information flow.

Legend: P position, S key position, H n_heads, G n_key_value_heads, K d_head, D d_model.

Pre-norm blocks: A[h, i, j] * v[j, h] @ W_O[h] and b_O. Sandwich and sublayer_output blocks norm attention's
output first (ln1_post); with its scale s_i frozen at target i that norm is linear
(``Decoder.apply_output_norm``), so the parts become A / s_i times its linear part of v @ W_O, and the constant
b_O through it plus a LayerNorm's own bias: they sum exactly to ``hook_attn_out``. Post-norm models are refused.
The names are re-exported by ``experiments.flow``.
"""

from __future__ import annotations

from typing import Optional

import torch
from jaxtyping import Float
from torch import Tensor

from workbench.errors import InputError
from workbench.tokens_api import TextOrTokens


def _hook_names(model) -> list[str]:
    """The hook points ``flow_contributions`` reads, in one forward pass."""
    cfg, names = model.cfg, []
    for l in range(cfg.n_layers):
        names += [f"blocks.{l}.hook_resid_pre", f"blocks.{l}.hook_resid_post", f"blocks.{l}.attn.hook_pattern",
                  f"blocks.{l}.attn.hook_v"]
        scale_name = model.output_norm_scale_hook(l, "attn")  # the divisor of attention's output norm, if any
        names += [] if scale_name is None else [scale_name]
        if not cfg.attn_only:
            names.append(f"blocks.{l}.hook_mlp_out")
            if not cfg.parallel_attn_mlp:
                names.append(f"blocks.{l}.hook_resid_mid")
    return names


def _require_flow_model(model) -> None:
    if model.cfg.norm_placement == "post":
        raise InputError("information flow needs residual updates that are sums of their parts (norm_placement "
                         "'pre', 'sandwich' or 'sublayer_output'); this model is post-norm, ln(x + f(x)): the norm "
                         "after each residual sum mixes its parts non-linearly")


def _one_prompt(model, tokens: TextOrTokens) -> Tensor:
    tokens_BP = model.as_tokens(tokens)
    if tokens_BP.shape[0] != 1:
        raise InputError(f"information flow reads one prompt; got a batch of {tokens_BP.shape[0]}")
    return tokens_BP


def run_flow_cache(model, tokens: TextOrTokens):
    """One forward pass caching what the contributions need (``_hook_names``); returns the ActivationCache.

    Example:
        >>> sorted(run_flow_cache(model, "The cat sat"))[:4]
        ['blocks.0.attn.hook_pattern', 'blocks.0.attn.hook_v', 'blocks.0.hook_resid_post', 'blocks.0.hook_resid_pre']
    """
    _require_flow_model(model)
    names = set(_hook_names(model))
    with torch.no_grad():
        _, cache = model.run_with_cache(_one_prompt(model, tokens), stop_at_layer=model.cfg.n_layers,
                                        names_filter=lambda n: n in names)
    return cache


def _value_out(model, cache, layer: int) -> Float[Tensor, "key_pos n_heads d_model"]:
    """v[j, h] @ W_O[h] for every source and head (a key/value head repeated for its group's query heads)."""
    v_SGK = cache[f"blocks.{layer}.attn.hook_v"][0].float()
    v_SHK = v_SGK.repeat_interleave(model.cfg.n_heads // v_SGK.shape[1], dim=1)  # query head h reads kv head h // g
    return torch.einsum("shk,hkd->shd", v_SHK, model.layer_W_O(layer).float())


def _attention_parts(model, cache, layer: int) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(weights [P, S, H], values [S, H, D], constant [P, D] or None): weights[i, j, h] * values[j, h] summed over
    sources and heads, plus the constant, is layer ``layer``'s attention output at i as it joins the residual
    stream (``hook_attn_out``). Without an output norm: A, v @ W_O and b_O. With one (sandwich, sublayer_output),
    its scale s_i frozen at target i: A / s_i, its linear part of v @ W_O (the norm is linear per target, so it
    commutes with the weighting), and b_O through it plus a LayerNorm's own bias."""
    pattern_PSH = cache[f"blocks.{layer}.attn.hook_pattern"][0].float().permute(1, 2, 0)
    values_SHD = _value_out(model, cache, layer)
    P, D = pattern_PSH.shape[0], values_SHD.shape[-1]
    b_O = model.layer_b_O(layer)  # None without a bias (model.b_O would be zeros)
    scale_name = model.output_norm_scale_hook(layer, "attn")
    if scale_name is None:
        return pattern_PSH, values_SHD, None if b_O is None else b_O.float().expand(P, D)
    scale_P1 = cache[scale_name][0].float()
    unit = torch.ones(1, device=scale_P1.device)
    values_SHD = model.apply_output_norm(layer, "attn", values_SHD, frozen_scale=unit).float()
    constants = [] if b_O is None else [model.apply_output_norm(layer, "attn", b_O.float().expand(P, D),
                                                                 frozen_scale=scale_P1).float()]
    norm_bias_D = model.output_norm_bias(layer, "attn")
    if norm_bias_D is not None:  # a LayerNorm output norm's own bias
        constants.append(norm_bias_D.float().to(scale_P1.device).expand(P, D))
    return pattern_PSH / scale_P1[:, :, None], values_SHD, sum(constants) if constants else None


def attention_by_source(model, cache, layer: int) -> Float[Tensor, "pos key_pos n_heads d_model"]:
    """c[i, j, h] = A[h, i, j] * v[j, h] @ W_O[h]: layer ``layer``'s attention output at i split by source and head.

    ``cache`` from ``run_flow_cache``; summed over sources and heads, plus ``b_O``, it is ``hook_attn_out``.
    With an output norm (sandwich, sublayer_output) each c[i, j, h] is read through it with its scale frozen at
    target i (see the module docstring), so the sum plus the constant part is still ``hook_attn_out``.
    Holds P * S * H * D floats: the contributions themselves are computed in chunks.

    Example:
        >>> c_PSHD = attention_by_source(model, run_flow_cache(model, tokens), layer=0)
        >>> c_PSHD.shape   # [pos, key_pos, n_heads, d_model]
        torch.Size([14, 14, 4, 128])
        >>> torch.allclose(c_PSHD.sum((1, 2)), cache["blocks.0.hook_attn_out"][0], atol=1e-5)   # no b_O here
        True
    """
    weights_PSH, values_SHD, _ = _attention_parts(model, cache, layer)
    return weights_PSH[..., None] * values_SHD[None]
