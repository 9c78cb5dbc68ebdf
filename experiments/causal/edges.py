"""TransformerLens 4.3's edge-granularity ``attribution_patch`` and ``faithfulness`` on our models, names and
signatures kept.

TransformerLens's tools switch on ``use_attn_result``, ``use_split_qkv_input`` and ``use_hook_mlp_in``
(ours has all three) and then pick the hook points to cache from ``model.hook_dict``, which on a
``TransformerBridge`` lists every point under each of its names. Ours lists each point once, under its
own name, and the per-head inputs the tools read, the bridge's ``blocks.{l}.attn.hook_q_input`` (``k``,
``v``), are aliases of our ``blocks.{l}.hook_q_input``: so these call the tools on the model seen with
the bridge's ``hook_dict`` (aliases included), and everything else is the model itself.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import transformer_lens.tools.analysis as tla

from workbench import Decoder
from workbench.errors import InputError


class _WithAliasesInHookDict:
    """``model`` with ``hook_dict`` listing each point under its own name and each alias, as a bridge's does."""

    def __init__(self, model: Decoder):
        if not isinstance(model, Decoder):
            raise InputError(f"needs a workbench Decoder; got {type(model).__name__} (call "
                             "transformer_lens.tools.analysis's own on a TransformerBridge)")
        object.__setattr__(self, "_model", model)

    @property
    def hook_dict(self) -> dict:
        model = self._model
        return {**model.hook_dict, **{alias: model.hook_dict[own] for alias, own in model.hook_aliases.items()}}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)


def attribution_patch(model, clean: torch.Tensor, corrupt: torch.Tensor, metric_fn,
                      config: tla.EdgeAttributionConfig = tla.EdgeAttributionConfig()) -> tla.AttributionResult:
    """``transformer_lens.tools.analysis.attribution_patch`` on our model, node or edge granularity: the scores
    a ``TransformerBridge`` of the same weights gives; the model's switches are restored afterwards.

    Example:
        >>> mlp_model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=20, n_ctx=8))
        >>> clean, corrupt = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
        >>> result = attribution_patch(mlp_model, clean, corrupt, lambda logits: logits[0, -1, 7],
        ...                            tla.EdgeAttributionConfig(granularity="edge"))
        >>> len(result.edge_scores) > 0, mlp_model.cfg.use_hook_mlp_in
        (True, False)
    """
    return tla.attribution_patch(_WithAliasesInHookDict(model), clean, corrupt, metric_fn, config)


def faithfulness(model, clean: torch.Tensor, corrupt: torch.Tensor, metric_fn, circuit,
                 config: tla.FaithfulnessConfig = tla.FaithfulnessConfig(), *,
                 mean_tokens: Optional[torch.Tensor] = None) -> tla.FaithfulnessResult:
    """``transformer_lens.tools.analysis.faithfulness`` on our model: how much of the clean-to-corrupt metric gap
    the ``circuit`` (edges from ``attribution_patch``) recovers, as on a bridge of the same weights.

    Example:
        >>> mlp_model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=20, n_ctx=8))
        >>> clean, corrupt = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
        >>> metric = lambda logits: logits[0, -1, 7]
        >>> edges = attribution_patch(mlp_model, clean, corrupt, metric,
        ...                           tla.EdgeAttributionConfig(granularity="edge")).top_edges(5)
        >>> faithfulness(mlp_model, clean, corrupt, metric, edges).circuit_size
        5
    """
    return tla.faithfulness(_WithAliasesInHookDict(model), clean, corrupt, metric_fn, circuit, config,
                            mean_tokens=mean_tokens)
