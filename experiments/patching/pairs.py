"""Clean and corrupted prompts paired for patching and circuits (``PairedPrompts``), the metric they score, and one
patched run.

Legend: B batch, P position, V d_vocab.

``PairedPrompts`` is the one prompt-pair type every patching and circuit entry point takes as its first data
argument: the clean and corrupted tokens padded to one width (each with its own mask), the metric (the logit
difference of answer over wrong at each prompt's last real token by default, any ``experiments.metrics`` metric or
a callable), built once by ``PairedPrompts.from_prompts`` from texts, token ids or an ``IOIDataset``. The older
call forms (clean and corrupted tokens, answer and wrong tokens, masks, a metric as separate arguments) are turned
into one here, by ``takes_pairs``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from workbench.tokens_api import TextOrTokens
from experiments.datasets import IOIDataset
from experiments.metrics import (LogitDiff, Metric, MetricLike, PositionSelector, PromptBatch, TokenIds, as_metric,
                                 logit_diff, prompt_batch)
from experiments.sites import Site
from workbench.errors import InputError


@dataclass(frozen=True, eq=False)
class PairedPrompts:
    """Clean and corrupted prompts aligned position by position (one width, each with its mask) and the metric scored
    on them (None when only patched runs are asked for).

    Example:
        >>> pairs = PairedPrompts.from_prompts(model, ["The cat sat", "The cat"], ["The cut sat", "The cut"],
        ...                                    answers=" on", wrong=" s")
        >>> pairs.size, pairs.lengths.tolist(), type(pairs.metric).__name__, pairs.answer_tokens.tolist()
        (2, [6, 4], 'LogitDiff', [542, 542])
    """

    clean: PromptBatch
    corrupt: PromptBatch
    metric: Optional[Metric] = None

    @classmethod
    def from_prompts(cls, model, clean, corrupt=None, answers: Optional[TokenIds] = None,
                     wrong: Optional[TokenIds] = None, *, metric: Optional[MetricLike] = None,
                     position: Optional[PositionSelector] = None, clean_mask: Optional[Tensor] = None,
                     corrupt_mask: Optional[Tensor] = None, padding_side: str = "right") -> "PairedPrompts":
        """Pairs from texts or token ids (``patch_pair``), an ``IOIDataset`` (its corrupted twins; by default
        logit[IO] - logit[S]), a (clean, corrupt[, clean_mask, corrupt_mask]) tuple, or ``PairedPrompts`` (its
        metric replaced when one is given). The metric: ``metric`` (with ``position`` as its selector), else the
        logit difference of ``answers`` over ``wrong`` (one id or text, or one per prompt) at each prompt's last
        real token (or ``position``), else None.

        Example:
            >>> pairs = PairedPrompts.from_prompts(model, tokens, model.to_tokens("The cat sat on the mat. The cut"),
            ...                                    " s", " and")
            >>> pairs.clean.tokens.shape, pairs.metric.position
            (torch.Size([1, 14]), 'last')
        """
        if isinstance(clean, (PairedPrompts, IOIDataset)) and corrupt is not None:
            raise InputError(f"a {type(clean).__name__} holds its own corrupted prompts: pass corrupt=None")
        if isinstance(clean, PairedPrompts):
            if metric is None and answers is None and position is not None:
                metric = clean.metric  # its metric read at another position
            chosen = _chosen_metric(model, clean.size, answers, wrong, metric, position)
            return clean if chosen is None else cls(clean.clean, clean.corrupt, chosen)
        if isinstance(clean, IOIDataset):
            data = clean
            clean, corrupt, clean_mask, corrupt_mask = (data.clean_tokens, data.corrupt_tokens, data.clean_mask,
                                                        data.corrupt_mask)
            if metric is None and answers is None:
                answers, wrong = data.answer_tokens, data.wrong_tokens
        elif isinstance(clean, tuple) and corrupt is None and not _is_text_list(clean):
            if not 2 <= len(clean) <= 4:
                raise InputError(f"a tuple of pairs is (clean, corrupt[, clean_mask, corrupt_mask]), got {len(clean)} "
                                 f"items")
            clean, corrupt, *masks = clean
            clean_mask, corrupt_mask = (list(masks) + [None, None])[:2]
        if corrupt is None:
            raise InputError("pass corrupted prompts to pair with the clean ones (or an IOIDataset or PairedPrompts "
                             "as clean)")
        clean_batch, corrupt_batch = patch_pair(model, clean, corrupt, clean_mask, corrupt_mask, padding_side)
        return cls(clean_batch, corrupt_batch,
                   _chosen_metric(model, clean_batch.size, answers, wrong, metric, position))

    @property
    def size(self) -> int:
        return self.clean.size

    @property
    def lengths(self) -> Int[Tensor, "batch"]:
        """Each clean prompt's number of real tokens."""
        mask = self.clean.mask
        return torch.full((self.size,), self.clean.tokens.shape[1]) if mask is None else mask.sum(1)

    @property
    def answer_tokens(self) -> Optional[Int[Tensor, "batch"]]:
        """The logit difference's answer ids (None for another metric)."""
        return self.metric.answer_tokens if isinstance(self.metric, LogitDiff) else None

    @property
    def wrong_tokens(self) -> Optional[Int[Tensor, "batch"]]:
        """The logit difference's wrong ids (None for another metric)."""
        return self.metric.wrong_tokens if isinstance(self.metric, LogitDiff) else None

    @property
    def scored(self) -> Bool[Tensor, "batch pos"]:
        """Positions real in both prompts of a pair (edges at pads score zero)."""
        masks = [m for m in (self.clean.mask, self.corrupt.mask) if m is not None]
        full = torch.ones(self.clean.tokens.shape, dtype=torch.bool, device=self.clean.tokens.device)
        return full if not masks else (masks[0] & masks[-1])

    def rows(self, start: int, stop: int) -> "PairedPrompts":
        """Pairs ``start .. stop - 1``, the metric's per-row answers (and positions) with them."""
        pick = lambda batch: PromptBatch(batch.tokens[start:stop], None if batch.mask is None  # noqa: E731
                                         else batch.mask[start:stop])
        metric = None if self.metric is None else _metric_rows(self.metric, self.size, start, stop)
        return PairedPrompts(pick(self.clean), pick(self.corrupt), metric)


def _metric_rows(metric: Metric, rows: int, start: int, stop: int) -> Metric:
    """``metric`` for rows ``start .. stop - 1``: its tensors of one entry per row are sliced, the rest kept."""
    if not dataclasses.is_dataclass(metric):
        return metric
    changes = {}
    for field in dataclasses.fields(metric):
        value = getattr(metric, field.name)
        if isinstance(value, Tensor) and value.ndim == 1 and len(value) == rows and rows > 1:
            changes[field.name] = value[start:stop]
    return dataclasses.replace(metric, **changes) if changes else metric


def _chosen_metric(model, rows: int, answers: Optional[TokenIds], wrong: Optional[TokenIds],
                   metric: Optional[MetricLike], position: Optional[PositionSelector]) -> Optional[Metric]:
    if metric is None and answers is None and wrong is None:
        return None
    return patching_metric(model, rows, answers, wrong, metric, position)


def patch_pair(model, clean_tokens: TextOrTokens, corrupt_tokens: TextOrTokens, clean_mask: Optional[Tensor] = None,
               corrupt_mask: Optional[Tensor] = None, padding_side: str = "right") -> tuple[PromptBatch, PromptBatch]:
    """Clean and corrupted prompts aligned by padding to one width, each with its own mask.

    Lists of texts are tokenized together; token tensors of different widths are padded on
    ``padding_side``. Position p of a clean row is patched into position p of its corrupted row.

    Example:
        >>> clean, corrupt = patch_pair(model, ["The cat sat", "The cat"], ["The cut sat", "The cut"])
        >>> clean.tokens.shape, clean.mask.sum(1).tolist()             # one width, each row its own mask
        (torch.Size([2, 6]), [6, 4])
    """
    if _is_text_list(clean_tokens) and _is_text_list(corrupt_tokens) and len(clean_tokens) == len(corrupt_tokens):
        tokens, mask = model.to_tokens_and_mask(list(clean_tokens) + list(corrupt_tokens), padding_side=padding_side)
        n = len(clean_tokens)
        clean_tokens, corrupt_tokens, clean_mask, corrupt_mask = tokens[:n], tokens[n:], mask[:n], mask[n:]
    clean = prompt_batch(model, clean_tokens, clean_mask, padding_side)
    corrupt = prompt_batch(model, corrupt_tokens, corrupt_mask, padding_side)
    if clean.size != corrupt.size:
        raise InputError(f"there are {clean.size} clean prompts but {corrupt.size} corrupted ones; pair each clean "
                         f"prompt with one corrupted prompt")
    width = max(clean.tokens.shape[1], corrupt.tokens.shape[1])
    return _pad_to(model, clean, width, padding_side), _pad_to(model, corrupt, width, padding_side)


def _is_text_list(tokens: TextOrTokens) -> bool:
    return isinstance(tokens, (list, tuple)) and bool(tokens) and all(isinstance(t, str) for t in tokens)


def _pad_to(model, batch: PromptBatch, width: int, side: str) -> PromptBatch:
    """``batch`` padded with pad tokens (masked out) to ``width`` positions on ``side``."""
    B, P = batch.tokens.shape
    if P == width:
        return batch
    if side not in ("right", "left"):
        raise InputError(f"padding_side must be 'right' or 'left', got {side!r}")
    pad_id = model.tokenizer.pad_token_id if model.tokenizer is not None else None
    pad = torch.full((B, width - P), 0 if pad_id is None else pad_id, dtype=batch.tokens.dtype, device=batch.tokens.device)
    mask = batch.mask if batch.mask is not None else torch.ones(B, P, dtype=torch.bool, device=batch.tokens.device)
    parts = [(batch.tokens, mask), (pad, torch.zeros_like(pad, dtype=torch.bool))]
    if side == "left":
        parts.reverse()
    return PromptBatch(torch.cat([parts[0][0], parts[1][0]], 1), torch.cat([parts[0][1], parts[1][1]], 1))


def logit_diff_metric(answer_token: TokenIds, wrong_token: TokenIds, position: PositionSelector = "last") -> LogitDiff:
    """metric(logits [B, P, V], tokens) = mean over b of logits[b, pos_b, answer_b] - logits[b, pos_b, wrong_b].

    ``position`` is "last" (each row's last real token: the mask tells), an int, or one per row.

    Example:
        >>> logit_diff_metric(2, 0)(torch.tensor([[[1.0, 0.0, 3.0]]]), None).item()
        2.0
    """
    ids = [torch.as_tensor(token).reshape(-1).long() for token in (answer_token, wrong_token)]
    return LogitDiff(ids[0], ids[1], position)


def patching_metric(model, rows: int, answer_token: Optional[TokenIds], wrong_token: Optional[TokenIds],
                    metric: Optional[MetricLike], position: Optional[PositionSelector]) -> Metric:
    """The metric a patching run scores: ``metric`` when given, else the logit difference of answer over wrong.

    Example:
        >>> patching_metric(model, 2, " s", " and", None, None).position   # the logit difference at each row's last token
        'last'
    """
    if metric is not None:
        return as_metric(metric, position)
    if answer_token is None or wrong_token is None:
        raise InputError("patching needs answer_token and wrong_token (for the logit difference) or a metric=")
    return logit_diff(model, answer_token, wrong_token, rows, "last" if position is None else position)


# The call forms the entry points took before ``PairedPrompts``: the leading positional arguments that held the
# data, and the keywords that described it. ``takes_pairs`` turns any of them into one ``PairedPrompts``.
LEGACY_FORMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tokens": (("clean_tokens", "corrupt_tokens", "answer_token", "wrong_token"),
               ("metric", "position", "clean_mask", "corrupt_mask", "padding_side")),  # exact and gradient patching
    "pair": (("clean_tokens", "corrupt_tokens"), ("clean_mask", "corrupt_mask")),       # patched_run
    "circuits": (("clean", "corrupt", "metric"), ("clean_mask", "corrupt_mask")),       # edge and path patching
    "dataset": (("dataset", "metric"), ()),                                             # circuits over a dataset
}
_BUILD_ARGUMENT = {"clean_tokens": "clean", "clean": "clean", "dataset": "clean", "corrupt_tokens": "corrupt",
                   "corrupt": "corrupt", "answer_token": "answers", "wrong_token": "wrong"}


def takes_pairs(form: str, needs_metric: bool = True) -> Callable:
    """Decorates an entry point ``fn(model, pairs: PairedPrompts, ...)`` so that it also takes the older call
    ``form`` of ``LEGACY_FORMS`` (the data as separate positional or keyword arguments, as TransformerLens-style
    code calls it), turned into one ``PairedPrompts`` here; ``needs_metric``: an ``InputError`` when the pairs have
    no metric.

    Example:
        >>> @takes_pairs("tokens")
        ... def metric_gap(model, pairs):
        ...     return pairs.size, type(pairs.metric).__name__
        >>> metric_gap(model, tokens, tokens, " s", " and")            # the older form: tokens, answer, wrong
        (1, 'LogitDiff')
        >>> metric_gap(model, PairedPrompts.from_prompts(model, tokens, tokens, metric="loss"))
        (1, 'Loss')
    """
    positional, keywords = LEGACY_FORMS[form]

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def entry(model, *args, **kwargs):
            pairs, args = _pairs_of_call(model, positional, keywords, list(args), kwargs)
            if needs_metric and pairs.metric is None:
                raise InputError(f"{fn.__name__} needs a metric: answer and wrong tokens (the logit difference) or a "
                                 f"metric (experiments.metrics, or a callable (logits, tokens) -> one value per prompt)")
            return fn(model, pairs, *args, **kwargs)
        return entry
    return decorate


def _pairs_of_call(model, positional: tuple[str, ...], keywords: tuple[str, ...], args: list,
                   kwargs: dict) -> tuple[PairedPrompts, list]:
    """The call's ``PairedPrompts`` (given, or built from the older form's arguments) and the arguments left."""
    given = {}
    if "pairs" in kwargs:
        given[positional[0]] = kwargs.pop("pairs")
    elif args:
        given[positional[0]] = args.pop(0)
    if not isinstance(given.get(positional[0]), PairedPrompts):  # the older form: its data arguments come first
        while args and len(given) < len(positional):
            given[positional[len(given)]] = args.pop(0)
    elif positional[1:] == ("metric",) and args and _is_metric_like(args[0]):
        given["metric"] = args.pop(0)  # circuits over a dataset: (pairs, metric, ...) with the metric None or given
    for name in positional + keywords:
        if name in kwargs:
            if name in given:
                raise InputError(f"{name} is given twice: as a positional argument and as a keyword")
            given[name] = kwargs.pop(name)
    first = given.pop(positional[0], None)
    if first is None:
        raise InputError(f"pass the prompt pairs: a PairedPrompts (PairedPrompts.from_prompts) or "
                         f"{', '.join(positional)}")
    if isinstance(first, PairedPrompts) and not given:
        return first, args
    built = {_BUILD_ARGUMENT.get(name, name): value for name, value in given.items()}
    return PairedPrompts.from_prompts(model, first, **built), args


def _is_metric_like(value) -> bool:
    return value is None or isinstance(value, (str, Metric)) or callable(value)


@takes_pairs("pair", needs_metric=False)
@torch.no_grad()
def patched_run(model, pairs: PairedPrompts, hook_name: str, position: Optional[int] = None,
                head: Optional[int] = None, return_type: Optional[str] = "logits"):
    """Runs the corrupted prompts with the activation at ``hook_name`` taken from the clean run.

    ``position`` patches one position, ``head`` one head of an ``attn.hook_z``; neither patches all of it.

    Example:
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")   # ``tokens`` with its last token changed
        >>> patched = patched_run(model, PairedPrompts.from_prompts(model, tokens, corrupt),
        ...                       "blocks.0.hook_resid_pre")              # the whole residual stream
        >>> torch.allclose(patched, model(tokens), atol=1e-5)
        True
    """
    clean, corrupt = pairs.clean, pairs.corrupt
    model.layer_of(hook_name)  # an unknown name is an error naming it
    _, cache = model.run_with_cache(clean.tokens, attention_mask=clean.mask, names_filter=lambda name: name == hook_name)
    site, value = Site(hook_name, position, head), cache[hook_name]
    hook = lambda act, hook: site.write(act.clone(), value)
    return model.run_with_hooks(corrupt.tokens, attention_mask=corrupt.mask, return_type=return_type,
                                fwd_hooks=[(hook_name, hook)])


PatchingRun = PairedPrompts  # the name exact patching's prompts had before PairedPrompts served every entry point


def patching_run(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, progress, metric, position,
                 per_prompt, clean_mask, corrupt_mask, padding_side) -> PairedPrompts:
    """The older twelve-argument form of ``PairedPrompts.from_prompts`` (``progress`` and ``per_prompt`` are
    options of the run, not of the pairs, and are left out).

    Example:
        >>> run = patching_run(model, ["The cat"], ["The cut"], " s", " and", False, None, None, False, None, None, "right")
        >>> run.clean.size, type(run.metric).__name__
        (1, 'LogitDiff')
    """
    pairs = PairedPrompts.from_prompts(model, clean_tokens, corrupt_tokens, clean_mask=clean_mask,
                                       corrupt_mask=corrupt_mask, padding_side=padding_side)
    return PairedPrompts(pairs.clean, pairs.corrupt,
                         patching_metric(model, pairs.size, answer_token, wrong_token, metric, position))
