"""What an ablation changes, for one prompt or the mean over a batch: a metric clean and ablated, each
token's loss, the top predictions.

Legend: B batch, P position.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from experiments._batched import metric_from_final_resid
from experiments._tokens import str_tokens
from workbench.tokens_api import TextOrTokens
from experiments.ablation.hooks import Hook, hooks_for_input
from experiments.ablation.targets import AblationTarget, Method, check_method
from experiments.metrics import (Metric, MetricLike, PositionSelector, PromptBatch, as_metric, prompt_batch,
                                 require_per_prompt_values)
from workbench.errors import InputError


def _one_row(batch: PromptBatch, row: int) -> tuple[int, Tensor]:
    """``row`` (negative from the end) checked against the batch, and that row's real columns (bool [P])."""
    if not -batch.size <= row < batch.size:
        raise InputError(f"row={row} is outside the batch of {batch.size} prompt(s)")
    row %= batch.size
    real_P = batch.mask[row] if batch.mask is not None else torch.ones_like(batch.tokens[row], dtype=torch.bool)
    return row, real_P


@torch.no_grad()
def per_token_loss_change(model, tokens: TextOrTokens, targets: Sequence[AblationTarget], method: Method = "zero",
                          reference_tokens: Optional[TextOrTokens] = None, *, row: int = 0,
                          attention_mask: Optional[Tensor] = None, padding_side: str = "right",
                          reference_mask: Optional[Tensor] = None,
                          reference_means: Optional[dict] = None) -> pd.DataFrame:
    """Loss of predicting each token of prompt ``row``, clean and ablated.

    Row ``position`` p is the loss of predicting the prompt's token p from its positions < p
    (p >= 1), counted over the prompt's real tokens only: a padded row gives the table of its
    prompt alone. The whole batch runs (it is the default reference of "mean" and "resample");
    ``attention_mask``, ``padding_side``, ``reference_mask`` and ``reference_means`` as in ``run_ablated``.

    Example:
        >>> table = per_token_loss_change(model, tokens, [AblationTarget("head", 1, 0)])
        >>> table.columns.tolist(), len(table)              # a loss for each of the 13 tokens after the first
        (['position', 'token', 'clean_loss', 'ablated_loss', 'delta'], 13)
        >>> per_token_loss_change(model, ["The cat sat", "The dog"], [AblationTarget("head", 1, 0)], row=1)["token"].tolist()
        ['The', ' do', 'g']
    """
    run = _clean_and_ablated(model, tokens, targets, method, reference_tokens, None, row, attention_mask,
                             padding_side, reference_mask, reference_means)
    return _loss_table(model, run)


class _Runs(NamedTuple):
    """The checked inputs and the two forwards every table here reads: (logits [B, P, V], per-token loss
    [B, P - 1]) clean and with the ablation's hooks."""
    batch: PromptBatch
    row: int
    real_P: Tensor
    column: Optional[int]
    clean: tuple[Tensor, Tensor]
    ablated: tuple[Tensor, Tensor]


def _clean_and_ablated(model, tokens: TextOrTokens, targets: Sequence[AblationTarget], method: Method,
                       reference_tokens: Optional[TextOrTokens], position: Union[int, Literal["last"], None], row: int,
                       attention_mask: Optional[Tensor], padding_side: str, reference_mask: Optional[Tensor],
                       reference_means: Optional[dict]) -> _Runs:
    """The batch, ``row`` and (``position`` not None) its column checked before any forward, then the clean run and
    the ablated one."""
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    row, real_P = _one_row(batch, row)
    column = None if position is None else _prediction_column(batch, row, real_P, position)
    hooks = hooks_for_input(model, batch, targets, method, reference_tokens, reference_mask, reference_means,
                            padding_side)
    # The blocks before the first ablated one compute the same in both runs: the ablated run starts from the clean
    # run's residual stream entering that block (``Decoder.forward``'s ``start_at_layer``, as ``experiments._batched``
    # resumes its edits), so an ablation in the last layer costs one block, not a second forward.
    first = min(model.layer_of(name) for name, _ in hooks)
    entering = f"blocks.{first}.hook_resid_pre"
    clean, cache = model.run_with_cache(batch.tokens, attention_mask=batch.mask, return_type="both",
                                        loss_per_token=True, names_filter=entering)
    ablated = model.run_with_hooks(cache[entering], start_at_layer=first, tokens=batch.tokens,
                                   attention_mask=batch.mask, return_type="both", loss_per_token=True, fwd_hooks=hooks)
    return _Runs(batch, row, real_P, column, clean, ablated)


def _loss_table(model, run: _Runs) -> pd.DataFrame:
    batch, row, real_P = run.batch, run.row, run.real_P
    clean, ablated = run.clean[1][row], run.ablated[1][row]
    scored = real_P[:-1] & real_P[1:]  # loss p predicts column p + 1 from column p
    if not bool(scored.any()):
        raise InputError(f"prompt {row} has fewer than two real tokens: no next-token loss to show")
    clean, ablated = clean[scored].float().cpu(), ablated[scored].float().cpu()
    positions = (real_P.long().cumsum(0) - 1)[1:][scored]  # each predicted token's position in its prompt
    return pd.DataFrame({"position": positions.cpu().numpy(), "token": str_tokens(model, batch.tokens[row, 1:][scored]),
                         "clean_loss": clean.numpy(), "ablated_loss": ablated.numpy(),
                         "delta": (ablated - clean).numpy()})


@torch.no_grad()
def top_predictions_change(model, tokens: TextOrTokens, targets: Sequence[AblationTarget], method: Method = "zero",
                           k: int = 5, reference_tokens: Optional[TextOrTokens] = None,
                           position: Union[int, Literal["last"]] = "last", *, row: int = 0,
                           attention_mask: Optional[Tensor] = None, padding_side: str = "right",
                           reference_mask: Optional[Tensor] = None,
                           reference_means: Optional[dict] = None) -> pd.DataFrame:
    """The top-k next-token predictions of prompt ``row`` at ``position``, clean beside ablated.

    ``position`` is "last" (the prompt's last real token) or an index into the prompt's real tokens
    (negative from its end), so a padded row reads as its prompt alone. Arguments as
    ``per_token_loss_change``.

    Columns: rank, clean_token, clean_token_id, clean_prob, ablated_token, ablated_token_id,
    ablated_prob, and ablated_prob_of_clean (how the clean prediction fares after ablation).

    Example:
        >>> top = top_predictions_change(model, tokens, [AblationTarget("head", 1, 0)], k=3)
        >>> top[["rank", "clean_token", "ablated_token"]]
           rank clean_token ablated_token
        0     1           s             .
        1     2         and           and
        2     3          is            is
    """
    run = _clean_and_ablated(model, tokens, targets, method, reference_tokens, position, row, attention_mask,
                             padding_side, reference_mask, reference_means)
    return _top_table(model, run, k)


@torch.no_grad()
def loss_and_top_predictions_change(model, tokens: TextOrTokens, targets: Sequence[AblationTarget],
                                    method: Method = "zero", k: int = 5,
                                    reference_tokens: Optional[TextOrTokens] = None,
                                    position: Union[int, Literal["last"]] = "last", *, row: int = 0,
                                    attention_mask: Optional[Tensor] = None, padding_side: str = "right",
                                    reference_mask: Optional[Tensor] = None,
                                    reference_means: Optional[dict] = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``per_token_loss_change`` and ``top_predictions_change`` of one ablation, from one clean and one ablated
    forward (each alone runs both). Arguments as theirs.

    Example:
        >>> losses, top = loss_and_top_predictions_change(model, tokens, [AblationTarget("head", 1, 0)], k=3)
        >>> losses.equals(per_token_loss_change(model, tokens, [AblationTarget("head", 1, 0)]))
        True
        >>> top.equals(top_predictions_change(model, tokens, [AblationTarget("head", 1, 0)], k=3))
        True
    """
    run = _clean_and_ablated(model, tokens, targets, method, reference_tokens, position, row, attention_mask,
                             padding_side, reference_mask, reference_means)
    return _loss_table(model, run), _top_table(model, run, k)


def _prediction_column(batch: PromptBatch, row: int, real_P: Tensor, position: Union[int, Literal["last"]]) -> int:
    """The batch column of prompt ``row``'s ``position`` ("last" or an index into its real tokens)."""
    columns = real_P.nonzero().flatten()
    index = -1 if position == "last" else position
    if isinstance(index, str) or not -len(columns) <= int(index) < len(columns):
        raise InputError(f"position must be 'last' or an index into prompt {row}'s {len(columns)} real tokens, "
                         f"got {position!r}")
    return int(columns[int(index)])


def _top_k(logits_V: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(ids, probabilities) of the ``k`` likeliest tokens, and the log normaliser: exp(logit - logsumexp), the
    softmax of the few tokens shown without one over the whole vocabulary."""
    logits_V = logits_V.float()
    log_norm = logits_V.logsumexp(-1)
    top_logits, ids = logits_V.topk(k)
    return ids, (top_logits - log_norm).exp(), log_norm


def _top_table(model, run: _Runs, k: int) -> pd.DataFrame:
    at = (run.row, run.column)
    ablated_V = run.ablated[0][at].float()
    clean_ids, clean_p, _ = _top_k(run.clean[0][at], k)
    ablated_ids, ablated_p, ablated_log_norm = _top_k(ablated_V, k)
    return pd.DataFrame({
        "rank": np.arange(1, k + 1),
        "clean_token": str_tokens(model, clean_ids.cpu()), "clean_token_id": clean_ids.cpu().numpy(),
        "clean_prob": clean_p.cpu().numpy(),
        "ablated_token": str_tokens(model, ablated_ids.cpu()), "ablated_token_id": ablated_ids.cpu().numpy(),
        "ablated_prob": ablated_p.cpu().numpy(),
        "ablated_prob_of_clean": (ablated_V[clean_ids] - ablated_log_norm).exp().cpu().numpy(),
    })


@torch.no_grad()
def top_predictions(model, tokens: TextOrTokens, k: int = 5, position: Union[int, Literal["last"]] = "last", *,
                    row: int = 0, attention_mask: Optional[Tensor] = None,
                    padding_side: str = "right") -> pd.DataFrame:
    """The clean model's ``k`` likeliest next tokens of prompt ``row`` at ``position``: DataFrame[rank, token,
    token_id, prob], the clean columns of ``top_predictions_change`` without an ablation (one forward, and only
    that position unembedded). Arguments as ``top_predictions_change``'s.

    Example:
        >>> top = top_predictions(model, tokens, k=3)
        >>> top["token_id"].tolist() == top_predictions_change(model, tokens, [AblationTarget("head", 1, 0)],
        ...                                                    k=3)["clean_token_id"].tolist()
        True
    """
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    row, real_P = _one_row(batch, row)
    column = _prediction_column(batch, row, real_P, position)
    resid_BPD = model(batch.tokens, attention_mask=batch.mask, stop_at_layer=model.cfg.n_layers)
    ids, probs, _ = _top_k(model.logits_from_resid(resid_BPD[row, column][None, None])[0, 0], k)
    return pd.DataFrame({"rank": np.arange(1, k + 1), "token": str_tokens(model, ids.cpu()),
                         "token_id": ids.cpu().numpy(), "prob": probs.cpu().numpy()})


def _metric_of_run(model, batch: PromptBatch, metric: Metric, hooks: list[Hook]) -> Tensor:
    """The metric of each row ([B], or [1] for a batch-level metric) of one run under ``hooks``.

    Read from the final residual stream (``_batched.metric_from_final_resid``): a metric at one
    position per row unembeds only those positions, and the loss is tiled, never [B, P, V] at once.
    """
    # stop_at_layer=n_layers: the blocks run and nothing is unembedded (return_type=None still would be).
    resid_BPD = model.run_with_hooks(batch.tokens, attention_mask=batch.mask, stop_at_layer=model.cfg.n_layers,
                                     fwd_hooks=list(hooks))
    return metric_from_final_resid(model, resid_BPD, batch, metric)[0].float().cpu()


@torch.no_grad()
def ablation_effect(model, tokens: TextOrTokens, targets: Sequence[AblationTarget], metric: MetricLike = "loss",
                    method: Method = "zero", reference_tokens: Optional[TextOrTokens] = None, *,
                    position: Optional[PositionSelector] = None, per_prompt: bool = False,
                    attention_mask: Optional[Tensor] = None, padding_side: str = "right",
                    reference_mask: Optional[Tensor] = None,
                    reference_means: Optional[dict] = None) -> pd.DataFrame:
    """The metric of the clean and the ablated run: DataFrame[clean, ablated, delta], delta = ablated - clean.

    ``metric``: "loss" (each prompt's mean next-token loss over its real tokens), an
    ``experiments.metrics`` metric (``LogitDiff``, ``TokenProbability``; e.g. ``logit_diff(model,
    answers, wrongs, rows=B)`` with one answer per prompt) or a callable ``(logits, tokens) -> scalar or
    [batch]`` over the logits at ``position`` ("last": each row's last real token). One row holding
    the means over prompts, or with ``per_prompt=True`` one row per prompt (a ``prompt`` column
    first). A padded batch takes ``attention_mask`` (a list of texts builds it); the reference
    arguments are ``run_ablated``'s. With a fixed reference (or zero ablation) the batch's values are
    the means of each prompt's values run alone. ``df.attrs`` holds the per-prompt lists too.

    Example:
        >>> ablation_effect(model, ["The cat sat on the mat.", "The dog ran"], [AblationTarget("head", 0, 1)]).round(2)
           clean  ablated  delta
        0   6.23     7.89   1.66
    """
    check_method(method)
    batch = prompt_batch(model, tokens, attention_mask, padding_side)
    metric = as_metric(metric, position)
    hooks = hooks_for_input(model, batch, targets, method, reference_tokens, reference_mask, reference_means,
                            padding_side)
    clean_R = _metric_of_run(model, batch, metric, [])
    ablated_R = _metric_of_run(model, batch, metric, hooks)
    if per_prompt:
        require_per_prompt_values(len(clean_R), batch.size, "ablation")
        table = pd.DataFrame({"prompt": np.arange(batch.size), "clean": clean_R.numpy(), "ablated": ablated_R.numpy()})
    else:
        table = pd.DataFrame({"clean": [float(clean_R.mean())], "ablated": [float(ablated_R.mean())]})
    table["delta"] = table["ablated"] - table["clean"]
    table.attrs.update(method=method, targets=[str(t) for t in targets], clean_metric_per_prompt=clean_R.tolist(),
                       ablated_metric_per_prompt=ablated_R.tolist())
    return table


