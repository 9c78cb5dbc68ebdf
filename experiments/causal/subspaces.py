"""TransformerLens 4.3's ``attention_head_subspace_affinity`` on our models, name and signature kept.

TransformerLens's tool reads each attention layer's per-head ``W_Q``/``W_K``/``W_V``/``W_O`` through a
``TransformerBridge``'s ``blocks_with("attn")``, with a grouped-query model's K/V on its own key/value
heads (never expanded per query head). Ours reads the same matrices from the model's public weights
(``model.W_Q`` ..., whose GQA ``W_K``/``W_V`` are expanded: every group's first copy is its key/value
head) and hands them to the tool unchanged, so the scores are the bridge's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import transformer_lens.tools.analysis as tla
from transformer_lens.tools.analysis.projection_kernel import HeadAffinityResult

from workbench import Decoder
from workbench.errors import InputError


def _attention_blocks(model: Decoder) -> SimpleNamespace:
    """The model as the tool reads a bridge: ``cfg`` and ``blocks_with("attn")`` -> [(layer, block)], each
    ``block.attn`` holding [heads, d_model, d_head] matrices (``W_O`` [heads, d_head, d_model])."""
    group = model.cfg.n_heads // model.cfg.n_key_value_heads  # query heads per key/value head
    W_Q, W_K, W_V, W_O = (weight.detach() for weight in (model.W_Q, model.W_K, model.W_V, model.W_O))
    blocks = [(layer, SimpleNamespace(attn=SimpleNamespace(W_Q=W_Q[layer], W_K=W_K[layer, ::group],
                                                          W_V=W_V[layer, ::group], W_O=W_O[layer])))
              for layer in range(model.cfg.n_layers)]
    return SimpleNamespace(cfg=model.cfg, blocks_with=lambda submodule: blocks if submodule == "attn" else [])


def attention_head_subspace_affinity(model, *, source_role: str = "O", target_role: str,
                                     layer_order: str = "forward", rank: Optional[int] = None,
                                     rtol: Optional[float] = None) -> HeadAffinityResult:
    """``transformer_lens.tools.analysis.attention_head_subspace_affinity`` on our model: the projection-kernel
    affinity of each head's output subspace (O) with each later head's Q, K or V read subspace, with the
    bridge's values; K/V on a grouped-query model's own key/value heads, as on the bridge.

    Example:
        >>> affinity = attention_head_subspace_affinity(model, target_role="V")
        >>> affinity.scores.shape == (2, model.cfg.n_heads, 2, model.cfg.n_key_value_heads)
        True
    """
    if not isinstance(model, Decoder):
        raise InputError(f"needs a workbench Decoder; got {type(model).__name__} (call "
                         "transformer_lens.tools.analysis's own on a TransformerBridge)")
    return tla.attention_head_subspace_affinity(_attention_blocks(model), source_role=source_role,
                                                target_role=target_role, layer_order=layer_order, rank=rank,
                                                rtol=rtol)
