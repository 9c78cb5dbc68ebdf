"""Every head ablated in turn: ``head_sweep`` over a batch, ``head_sweep_per_prompt`` per prompt (a shard of
a sharded sweep, ``experiments.distributed``).

Legend: B batch, P position, L n_layers, H n_heads.

The clean run's residual stream is reused up to each head's layer and many heads are ablated per
batched pass (``experiments._batched``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from experiments._batched import DEFAULT_TOKENS_PER_PASS, Edit, score_edits, unedited_run
from experiments._progress import ProgressArg
from workbench.tokens_api import TextOrTokens
from experiments.ablation.references import reference_values, token_positions
from experiments.ablation.targets import AblationTarget, Method, check_method
from experiments.datasets import IOIDataset
from experiments.metrics import LogitDiff, MetricLike, PositionSelector, as_metric, per_prompt_table, prompt_batch
from workbench.errors import InputError


def head_sweep(model, tokens: TextOrTokens, metric: MetricLike = "loss", method: Method = "zero",
               reference_tokens: Optional[TextOrTokens] = None, progress: ProgressArg = True,
               tokens_per_pass: int = DEFAULT_TOKENS_PER_PASS, *, position: Optional[PositionSelector] = None,
               per_prompt: bool = False, attention_mask: Optional[Tensor] = None,
               padding_side: str = "right", reference_mask: Optional[Tensor] = None,
               reference_means: Optional[dict] = None) -> pd.DataFrame:
    """Ablates every (layer, head) in turn and scores it: DataFrame[layer, head, metric, delta].

    ``metric`` is "loss" (each prompt's mean next-token loss over its real tokens), a built-in
    ``experiments.metrics`` metric (``LogitDiff``, ``TokenProbability``: one position per row, the
    fast path) or a callable ``(logits, tokens) -> scalar or [batch]`` over the logits at
    ``position`` ("all" by default for a callable; "last" is each row's last real token).
    ``delta`` is ablated minus clean. Values are means over prompts; ``per_prompt=True`` gives a
    ``prompt`` column instead. A padded batch takes ``attention_mask`` (a list of texts builds it);
    "mean" and "resample" read the reference as ``ablation_hooks`` does (``reference_mask``,
    ``reference_means``; without a reference, the input batch itself, pads excluded).
    The clean run's residual stream is reused up to each head's layer and many heads are ablated
    per batched pass (see ``experiments._batched``), so this is several times faster than one
    ``run_with_hooks`` per head, with the same result.

    Example:
        >>> df = head_sweep(model, tokens, progress=False)
        >>> df.sort_values("delta", ascending=False).head(3).round(2)
           layer  head  metric  delta
        1      0     1    7.15   2.45
        3      0     3    5.54   0.84
        4      1     0    5.12   0.42
    """
    check_method(method)
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    metric = as_metric(metric, position)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    z_names = [f"blocks.{l}.attn.hook_z" for l in range(L)]
    clean_R, resid_pre, _ = unedited_run(model, batch, metric)
    values = {}
    if method != "zero":
        own = reference_tokens is None and reference_means is None  # the input batch is its own reference
        shift = 1 if (method == "resample" and own) else 0
        with torch.no_grad():
            values = reference_values(model, set(z_names), method, batch.tokens if own else reference_tokens, shift,
                                      reference_mask=batch.mask if own else reference_mask,
                                      reference_means=reference_means, padding_side=padding_side)
    B, P = batch.tokens.shape
    positions_BP = token_positions(batch.mask)
    edits = []
    for layer in range(L):
        value = values[z_names[layer]](B, P, positions_BP) if values else None
        edits += [Edit(AblationTarget("head", layer, head).site, value) for head in range(H)]
    scores_nR = score_edits(model, resid_pre, batch, edits, metric, progress, tokens_per_pass, desc="head sweep")
    labels = pd.DataFrame({"layer": np.repeat(np.arange(L), H), "head": np.tile(np.arange(H), L)})
    if per_prompt:
        table = per_prompt_table(labels, scores_nR, batch.size, "head sweep")
        table["delta"] = table["metric"] - clean_R.numpy()[table["prompt"]]
    else:
        table = labels.assign(metric=scores_nR.mean(1).numpy())
        table["delta"] = table["metric"] - float(clean_R.mean())
    table.attrs.update(clean_metric=float(clean_R.mean()), clean_metric_per_prompt=clean_R.tolist())
    return table




@torch.no_grad()
def head_sweep_per_prompt(model, tokens: Union[IOIDataset, Tensor, Sequence[str]], metric="loss",
                          method: str = "zero", *, attention_mask: Optional[Tensor] = None,
                          reference_tokens=None, reference_mask: Optional[Tensor] = None,
                          reference_means: Optional[dict] = None, position=None,
                          progress: ProgressArg = False) -> pd.DataFrame:
    """``head_sweep(..., per_prompt=True)`` with each prompt's unablated metric: DataFrame[prompt, layer, head, clean, metric, delta].

    ``tokens`` may be an ``IOIDataset`` (its clean prompts and mask; ``metric="logit_diff"`` is its
    IO-minus-S logit difference). "mean" and "resample" need a fixed reference (``reference_tokens``
    or ``reference_means``): a shard is not the whole dataset, so its own mean would differ.

    Example:
        >>> from experiments.distributed import mean_over_prompts
        >>> prompts = ["The cat sat on the mat.", "The dog ran"]
        >>> rows = head_sweep_per_prompt(model, prompts)
        >>> rows.columns.tolist()
        ['prompt', 'layer', 'head', 'clean', 'metric', 'delta']
        >>> means = mean_over_prompts(rows.drop(columns="clean"), ["layer", "head"])
        >>> bool(np.allclose(means["delta"], head_sweep(model, prompts, progress=False)["delta"], atol=1e-6))
        True
        >>> rows = run_sharded(head_sweep_per_prompt, prompts, "toy-attn-2l")   # the same rows from Ray workers   # doctest: +SKIP
    """
    if method != "zero" and reference_tokens is None and reference_means is None:
        raise InputError(f"{method} ablation over shards needs reference_tokens or reference_means: each shard would "
                         f"otherwise use its own prompts as the reference, and shards would disagree")
    if isinstance(tokens, IOIDataset):
        data, tokens, attention_mask = tokens, tokens.clean_tokens, tokens.clean_mask
        if isinstance(metric, str) and metric == "logit_diff":
            metric = LogitDiff(data.answer_tokens, data.wrong_tokens)
    table = head_sweep(model, tokens, metric, method, reference_tokens, progress, position=position, per_prompt=True,
                       attention_mask=attention_mask, reference_mask=reference_mask, reference_means=reference_means)
    clean = np.asarray(table.attrs["clean_metric_per_prompt"], dtype=table["metric"].dtype)
    table["clean"] = clean[table["prompt"].to_numpy()]
    table = table.sort_values(["prompt", "layer", "head"], kind="stable", ignore_index=True)
    return table[["prompt", "layer", "head", "clean", "metric", "delta"]]


