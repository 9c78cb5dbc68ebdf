"""A feature's decoder direction in the residual stream and its direct effect on the logits (the path of
``experiments.neurons.direct_logit_effect``: the final norm's linear part at unit scale, then W_U)."""

from __future__ import annotations

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from experiments.features.activations import check_feature
from experiments.lens import promoted_and_suppressed
from workbench.errors import InputError
from workbench.sae import SAE


def residual_direction(model, sae: SAE, feature: int) -> Float[Tensor, "d_model"]:
    """What one unit of ``feature`` writes to the residual stream: ``W_dec[feature]`` for an SAE writing a
    ``d_model``-wide hook (the residual stream, an attention or MLP output); for an SAE on ``hook_z`` (heads
    flattened, or one head), the decoder row through that layer's ``W_O``. Anything else is an ``InputError``.

    Example:
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name":
        ...     "blocks.1.attn.hook_z"}, reshape_activations="hook_z"), {"W_enc": torch.zeros(128, 4),
        ...     "W_dec": torch.randn(4, 128), "b_enc": torch.zeros(4), "b_dec": torch.zeros(128)})
        >>> torch.allclose(residual_direction(model, sae, 2),
        ...                torch.einsum("hd,hdm->m", sae.W_dec[2].reshape(4, 32), model.W_O[1]), atol=1e-5)
        True
    """
    check_feature(sae, feature)
    cfg = sae.cfg
    row = sae.W_dec[feature].detach().float()
    head = cfg.metadata.hook_head_index
    if cfg.hook_name_out.endswith("hook_z") and (cfg.reshape_activations == "hook_z" or head is not None):
        W_O_HdD = model.W_O[model.layer_of(cfg.hook_name_out)].detach().float()
        if head is not None:
            return row.to(W_O_HdD.device) @ W_O_HdD[head]
        return torch.einsum("hd,hdm->m", row.to(W_O_HdD.device).reshape(W_O_HdD.shape[:2]), W_O_HdD)
    if cfg.d_out != model.cfg.d_model:
        raise InputError(f"{sae!r} writes {cfg.d_out} values per token at {cfg.hook_name_out!r}, not the residual "
                         f"stream's d_model={model.cfg.d_model}: its features have no direct logit effect")
    return row


@torch.no_grad()
def feature_logit_effect(model, sae: SAE, feature: int, k: int = 10, through_final_norm: bool = True) -> pd.DataFrame:
    """The ``k`` tokens one unit of ``feature`` promotes most and suppresses most, directly: its residual
    direction (``residual_direction``) through the final norm's linear part at unit scale (LayerNorm centres
    and multiplies by its gain, RMSNorm multiplies; no bias, no per-token divisor, a positive factor that keeps
    the ranking) when ``through_final_norm``, then ``W_U``. DataFrame[direction, rank, token, token_id, effect].

    Example:
        >>> _ = torch.manual_seed(0); sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=4,
        ...     metadata={"hook_name": "blocks.1.hook_resid_post"}), {"W_enc": torch.zeros(128, 4),
        ...     "W_dec": torch.randn(4, 128), "b_enc": torch.zeros(4), "b_dec": torch.zeros(128)})
        >>> effect = feature_logit_effect(model, sae, 3, k=2)
        >>> effect["direction"].tolist(), bool(effect.effect.iloc[0] > 0 > effect.effect.iloc[-1])
        (['promoted', 'promoted', 'suppressed', 'suppressed'], True)
    """
    direction_D = residual_direction(model, sae, feature).to(device=model.W_U.device, dtype=model.W_U.dtype)
    if through_final_norm:
        unit_scale = torch.ones(1, 1, dtype=direction_D.dtype, device=direction_D.device)
        direction_D = model.apply_final_norm(direction_D[None], frozen_scale=unit_scale)[0]
    return promoted_and_suppressed(model, direction_D.float() @ model.W_U.float(), k)
