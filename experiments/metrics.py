"""Metrics over a batch of prompts of different lengths: each row read at its own answer position.

Legend: B batch, P position, V d_vocab.

A dataset's prompts pad to one width, so position -1 of a padded row is a pad. A ``PromptBatch``
holds the tokens, the attention mask and each row's last real token; a metric reads the
logits at a ``position`` selector:

- ``"last"``: each row's own last real token (the default of the built-in metrics);
- an int: that column for every row (-1 is the last column: the last real token under left padding);
- a [B] tensor of positions, one per row;
- ``"all"``: every position, [B, P, V] (a user's callable over the whole logits).

Every metric returns one value per row ([B]); an experiment's batch value is the mean over rows,
so a batched result equals the mean of the single-prompt results, and ``per_prompt=True`` returns
the rows themselves. A user's callable may instead return one scalar for the batch (then there
are no per-prompt values).

The fast path: a metric that reads one position per row (``LogitDiff``, ``TokenProbability``, a
callable with a one-position selector) lets a sweep unembed only those positions, and ``Loss`` is
computed from the residual stream tile by tile (``Decoder.loss_from_resid``); a callable over
``"all"`` positions needs the full logits of every variant.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Literal, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from workbench.tokens_api import TextOrTokens
from workbench.errors import InputError

PositionSelector = Union[int, Literal["last", "all"], Int[Tensor, "batch"]]
MetricLike = Union[str, "Metric", Callable]
TokenIds = Union[int, str, Sequence[Union[int, str]], Int[Tensor, "batch"]]


@dataclass(frozen=True, eq=False)
class PromptBatch:
    """Token ids [B, P], the attention mask (bool [B, P], None when nothing is padding) and where each row ends.

    Example:
        >>> batch = PromptBatch(torch.tensor([[5, 6, 0], [5, 6, 7]]), torch.tensor([[1, 1, 0], [1, 1, 1]]).bool())
        >>> batch.last_positions.tolist()
        [1, 2]
    """

    tokens: Int[Tensor, "batch pos"]
    mask: Optional[Bool[Tensor, "batch pos"]] = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def last_positions(self) -> Int[Tensor, "batch"]:
        """Each row's last real token: the position whose logits predict what follows the prompt."""
        B, P = self.tokens.shape
        if self.mask is None:
            return torch.full((B,), P - 1, dtype=torch.long, device=self.tokens.device)
        columns = torch.arange(P, device=self.mask.device)
        return torch.where(self.mask, columns, -1).max(dim=1).values

    def positions(self, selector: PositionSelector) -> Optional[Int[Tensor, "batch"]]:
        """The position each row is read at under ``selector`` (None for "all").

        Example:
            >>> PromptBatch(torch.zeros(2, 4, dtype=torch.long)).positions(-1).tolist()
            [3, 3]
        """
        B, P = self.tokens.shape
        if isinstance(selector, str):
            if selector == "all":
                return None
            if selector == "last":
                return self.last_positions
            raise InputError(f"position must be 'last', 'all', an int or a tensor of one position per row, got {selector!r}")
        if isinstance(selector, Tensor) and selector.ndim == 1:
            if len(selector) != B:
                raise InputError(f"position has {len(selector)} entries but the batch has {B} rows; give one per row")
            positions = selector.to(device=self.tokens.device, dtype=torch.long)
        elif isinstance(selector, int) or (isinstance(selector, Tensor) and selector.ndim == 0):
            positions = torch.full((B,), int(selector), dtype=torch.long, device=self.tokens.device)
        else:
            raise InputError(f"position must be 'last', 'all', an int or a tensor of one position per row, got {selector!r}")
        if bool(((positions < -P) | (positions >= P)).any()):
            raise InputError(f"position {selector!r} is outside the prompts' {P} positions")
        return positions % P

    def repeat(self, n: int) -> "PromptBatch":
        """The batch stacked n times (n variants of every row, variant-major)."""
        return PromptBatch(self.tokens.repeat(n, 1), None if self.mask is None else self.mask.repeat(n, 1))


def prompt_batch(model, tokens: TextOrTokens, attention_mask: Optional[Tensor] = None,
                 padding_side: str = "right") -> PromptBatch:
    """Checked token ids and mask of ``tokens``: a list of texts pads on ``padding_side`` and builds its mask.

    Example:
        >>> batch = prompt_batch(model, ["The cat sat on the mat.", "The dog"])
        >>> batch.tokens.shape, batch.last_positions                   # padded on the right; each row's last token
        (torch.Size([2, 11]), tensor([10,  3]))
    """
    tokens_BP, mask_BP = model.as_tokens_and_mask(tokens, attention_mask=attention_mask, padding_side=padding_side)
    return PromptBatch(tokens_BP, None if mask_BP is None or bool(mask_BP.all()) else mask_BP)


def token_ids(model, tokens: TokenIds, rows: int, name: str) -> Int[Tensor, "batch"]:
    """One token id per row from an id, a text (one token), or a list / tensor of either with one entry per row.

    Example:
        >>> token_ids(model, " the", 3, "answer_token")
        tensor([293, 293, 293])
    """
    if isinstance(tokens, Tensor):
        ids = tokens.reshape(-1).long()
    elif isinstance(tokens, (list, tuple)):
        ids = torch.tensor([_one_id(model, item, name) for item in tokens], dtype=torch.long)
    else:
        ids = torch.tensor([_one_id(model, tokens, name)], dtype=torch.long)
    if len(ids) == 1:
        ids = ids.expand(rows)
    elif len(ids) != rows:
        raise InputError(f"{name} has {len(ids)} entries but there are {rows} prompts; give one per prompt or one for all")
    vocab = model.cfg.d_vocab
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise InputError(f"{name} holds ids outside the vocabulary (0..{vocab - 1}): {ids.tolist()}")
    return ids.to(model.cfg.device)


def _one_id(model, token: Union[int, str, Tensor], name: str) -> int:
    if isinstance(token, str):
        if model.tokenizer is None:
            raise InputError(f"{name}={token!r} is text but the model has no tokenizer; pass a token id")
        return model.to_single_token(token)
    try:
        return int(token)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be token ids or texts, got {token!r}") from None


class Metric:
    """A scalar per prompt from the logits at ``position``: ``per_prompt(logits, batch) -> [B]`` (or [1]).

    ``logits`` is [B, V] (each row at its selected position) or [B, P, V] when ``position == "all"``.
    Called on a whole [B, P, V] logits tensor, a metric returns the batch mean.
    """

    position: PositionSelector = "last"

    def per_prompt(self, logits: Tensor, batch: PromptBatch) -> Float[Tensor, "rows"]:
        raise NotImplementedError

    def values(self, logits_BPV: Float[Tensor, "batch pos d_vocab"], batch: PromptBatch) -> Float[Tensor, "rows"]:
        """The metric of each row from the full logits (reads the selected positions)."""
        return self.per_prompt(select_positions(logits_BPV, batch, self.position), batch)

    def __call__(self, logits_BPV: Tensor, tokens_BP: Optional[Tensor] = None,
                 attention_mask: Optional[Tensor] = None) -> Tensor:
        tokens_BP = tokens_BP if tokens_BP is not None else torch.zeros(logits_BPV.shape[:2], dtype=torch.long)
        mask = None if attention_mask is None else attention_mask.bool()
        return self.values(logits_BPV, PromptBatch(tokens_BP, mask)).mean()


def select_positions(x_BP_: Tensor, batch: PromptBatch, position: PositionSelector) -> Tensor:
    """``x`` [B, P, ...] at each row's selected position ([B, ...]), or whole for "all"; ``x`` may stack
    n variants of the batch ([n*B, P, ...]), each read at its row's position.

    Example:
        >>> x = torch.arange(6.).view(2, 3)
        >>> select_positions(x, PromptBatch(torch.zeros(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()), "last").tolist()
        [1.0, 5.0]
    """
    positions = batch.positions(position)
    if positions is None:
        return x_BP_
    rows = torch.arange(x_BP_.shape[0], device=x_BP_.device)
    return x_BP_[rows, positions.to(x_BP_.device).repeat(x_BP_.shape[0] // len(positions))]


@dataclass(frozen=True, eq=False)
class LogitDiff(Metric):
    """logits[b, pos_b, answer_b] - logits[b, pos_b, wrong_b] for each row b (ids: one, or one per row).

    Example:
        >>> metric = LogitDiff(torch.tensor([2]), torch.tensor([0]))
        >>> metric(torch.tensor([[[1.0, 0.0, 3.0]]])).item()
        2.0
    """

    answer_tokens: Int[Tensor, "batch"]
    wrong_tokens: Int[Tensor, "batch"]
    position: PositionSelector = "last"

    def per_prompt(self, logits_BV: Float[Tensor, "batch d_vocab"], batch: PromptBatch) -> Float[Tensor, "batch"]:
        logits_BV = logits_BV.float()
        rows = torch.arange(logits_BV.shape[0], device=logits_BV.device)
        answer, wrong = (_per_row(ids, logits_BV) for ids in (self.answer_tokens, self.wrong_tokens))
        return logits_BV[rows, answer] - logits_BV[rows, wrong]


@dataclass(frozen=True, eq=False)
class TokenProbability(Metric):
    """softmax(logits[b, pos_b])[token_b] for each row b; ``log=True`` gives the log-probability.

    Example:
        >>> round(TokenProbability(torch.tensor([0]))(torch.zeros(1, 1, 4)).item(), 4)
        0.25
    """

    tokens: Int[Tensor, "batch"]
    position: PositionSelector = "last"
    log: bool = False

    def per_prompt(self, logits_BV: Float[Tensor, "batch d_vocab"], batch: PromptBatch) -> Float[Tensor, "batch"]:
        log_probs_BV = logits_BV.float().log_softmax(-1)
        rows = torch.arange(log_probs_BV.shape[0], device=log_probs_BV.device)
        chosen = log_probs_BV[rows, _per_row(self.tokens, log_probs_BV)]
        return chosen if self.log else chosen.exp()


@dataclass(frozen=True, eq=False)
class Loss(Metric):
    """Each prompt's mean next-token loss over its real tokens (pads and positions predicting a pad left out).

    Example:
        >>> round(Loss()(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]])).item(), 4)   # ln 4
        1.3863
    """

    position: PositionSelector = "all"

    def per_prompt(self, logits_BPV: Float[Tensor, "batch pos d_vocab"], batch: PromptBatch) -> Float[Tensor, "batch"]:
        from workbench.loss import next_token_loss

        losses = next_token_loss(logits_BPV, batch.tokens.repeat(logits_BPV.shape[0] // batch.size, 1),
                                 per_token=True, attention_mask=None)
        return mean_over_scored(losses, batch.repeat(logits_BPV.shape[0] // batch.size))


def mean_over_scored(losses_BQ: Float[Tensor, "batch pos_minus_1"], batch: PromptBatch) -> Float[Tensor, "batch"]:
    """Each row's mean of per-token losses over the pairs of two real tokens (all pairs when unpadded).

    Example:
        >>> losses_BQ = torch.tensor([[1., 2., 3.]])   # the losses of 4 tokens' 3 next-token pairs
        >>> mean_over_scored(losses_BQ, PromptBatch(torch.zeros(1, 4, dtype=torch.long))).tolist()
        [2.0]
        >>> mean_over_scored(losses_BQ, PromptBatch(torch.zeros(1, 4, dtype=torch.long),
        ...                                         torch.tensor([[True, True, True, False]]))).tolist()   # padded
        [1.5]
    """
    if batch.mask is None:
        return losses_BQ.mean(1)
    scored = (batch.mask[:, :-1] & batch.mask[:, 1:]).to(losses_BQ.device)[:, :losses_BQ.shape[1]]
    counts = scored.sum(1)
    if bool((counts == 0).any()):
        raise InputError(f"prompt(s) {(counts == 0).nonzero().flatten().tolist()} have fewer than two real tokens: "
                         f"no next-token loss to score")
    return (losses_BQ * scored).sum(1) / counts


@dataclass(frozen=True, eq=False)
class CallableMetric(Metric):
    """A user's ``fn(logits, tokens) -> scalar or [B]`` over the logits at ``position``.

    ``logits`` is [B, V] for a one-position selector and [B, P, V] for "all". Returning [B] gives
    per-prompt values; a scalar is the batch's value.

    Example:
        >>> top_logit = CallableMetric(lambda logits, tokens: logits.max(-1).values, position="last")
        >>> top_logit(torch.tensor([[[1.0, 4.0]]])).item()
        4.0
    """

    fn: Callable[[Tensor, Tensor], Tensor]
    position: PositionSelector = "all"

    def per_prompt(self, logits: Tensor, batch: PromptBatch) -> Float[Tensor, "rows"]:
        n = logits.shape[0] // batch.size
        if n > 1:  # several variants of the batch: the user's function sees one batch at a time
            return torch.cat([self.per_prompt(chunk, batch) for chunk in logits.split(batch.size)])
        value = torch.as_tensor(self.fn(logits, batch.tokens)).float().to(logits.device)
        if value.ndim == 0:
            return value.reshape(1)
        if value.shape != (batch.size,):
            raise InputError(f"the metric function returned shape {tuple(value.shape)}; return a scalar or one value "
                             f"per prompt ({batch.size},)")
        return value


def as_metric(metric: Union[str, Metric, Callable], position: Optional[PositionSelector] = None) -> Metric:
    """A ``Metric`` from "loss", a built-in metric (its position replaced when ``position`` is given) or a callable.

    Example:
        >>> as_metric("loss")
        Loss(position='all')
    """
    if isinstance(metric, Metric):
        return metric if position is None else replace(metric, position=position)
    if metric == "loss":
        if position not in (None, "all"):
            raise InputError("the loss reads every position; position must be 'all' (or left out)")
        return Loss()
    if callable(metric):
        return CallableMetric(metric, "all" if position is None else position)
    raise InputError(f"metric must be 'loss', a Metric (LogitDiff, TokenProbability, Loss) or a callable "
                     f"(logits, tokens) -> scalar or [batch], got {metric!r}")


def require_per_prompt_values(rows: int, prompts: int, what: str) -> None:
    """An ``InputError`` when per-prompt values were asked of a metric that gives one value per batch.

    Example:
        >>> require_per_prompt_values(2, 2, "sweep")
        >>> require_per_prompt_values(1, 2, "sweep")
        Traceback (most recent call last):
        workbench.errors.InputError: per_prompt=True needs a metric with one value per prompt, but this sweep's metric returns one value for the whole batch; return a [batch] tensor from the metric function
    """
    if rows != prompts:
        raise InputError(f"per_prompt=True needs a metric with one value per prompt, but this {what}'s metric returns "
                         f"one value for the whole batch; return a [batch] tensor from the metric function")


def per_prompt_table(labels: pd.DataFrame, values_nR: Tensor, prompts: int, what: str) -> pd.DataFrame:
    """``labels`` (one row per variant) repeated for each prompt, with a ``prompt`` column and the ``metric`` values.

    Example:
        >>> per_prompt_table(pd.DataFrame({"head": [0, 1]}), torch.tensor([[1., 2.], [3., 4.]]), 2, "sweep").values.tolist()
        [[0.0, 0.0, 1.0], [0.0, 1.0, 2.0], [1.0, 0.0, 3.0], [1.0, 1.0, 4.0]]
    """
    n, R = values_nR.shape
    require_per_prompt_values(R, prompts, what)
    table = labels.loc[labels.index.repeat(R)].reset_index(drop=True)
    table.insert(len(labels.columns), "prompt", np.tile(np.arange(R), n))
    table["metric"] = values_nR.reshape(-1).numpy()
    return table


def logit_diff(model, answer_tokens: TokenIds, wrong_tokens: TokenIds, rows: int,
               position: PositionSelector = "last") -> LogitDiff:
    """The logit-difference metric with one answer and wrong token per row (texts or ids, one or one per row).

    Example:
        >>> metric = logit_diff(model, [" s", " and"], [" and", " s"], rows=2)   # row 1 asks the opposite of row 0
        >>> two = torch.cat([tokens, tokens])
        >>> [round(value, 2) for value in metric.values(model(two), prompt_batch(model, two)).tolist()]
        [0.55, -0.55]
    """
    return LogitDiff(token_ids(model, answer_tokens, rows, "answer_token"),
                     token_ids(model, wrong_tokens, rows, "wrong_token"), position)


def _per_row(ids: Tensor, logits_BV: Tensor) -> Tensor:
    """``ids`` (one, or one per row of a batch) for each of the rows of ``logits``, which may stack variants."""
    ids = torch.as_tensor(ids, device=logits_BV.device).reshape(-1)
    return ids.repeat(logits_BV.shape[0] // len(ids)) if len(ids) > 1 else ids.expand(logits_BV.shape[0])
