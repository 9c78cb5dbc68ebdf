"""Clean and corrupted prompts paired for patching, the metric a patching run scores, and one patched run.

Legend: B batch, P position, V d_vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from experiments._progress import ProgressArg
from experiments._tokens import TokensLike
from experiments.metrics import (LogitDiff, Metric, MetricLike, PositionSelector, PromptBatch, TokenIds, as_metric,
                                 logit_diff, prompt_batch)
from experiments.sites import Site
from workbench.errors import InputError


def logit_diff_metric(answer_token: TokenIds, wrong_token: TokenIds, position: PositionSelector = "last") -> LogitDiff:
    """metric(logits [B, P, V], tokens) = mean over b of logits[b, pos_b, answer_b] - logits[b, pos_b, wrong_b].

    ``position`` is "last" (each row's last real token: the mask tells), an int, or one per row.

    Example:
        >>> logit_diff_metric(2, 0)(torch.tensor([[[1.0, 0.0, 3.0]]]), None).item()
        2.0
    """
    ids = [torch.as_tensor(token).reshape(-1).long() for token in (answer_token, wrong_token)]
    return LogitDiff(ids[0], ids[1], position)


def patch_pair(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, clean_mask: Optional[Tensor] = None,
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


def _is_text_list(tokens: TokensLike) -> bool:
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


@torch.no_grad()
def patched_run(model, clean_tokens: TokensLike, corrupt_tokens: TokensLike, hook_name: str,
                position: Optional[int] = None, head: Optional[int] = None, return_type: Optional[str] = "logits",
                clean_mask: Optional[Tensor] = None, corrupt_mask: Optional[Tensor] = None):
    """Runs the corrupted tokens with the activation at ``hook_name`` taken from the clean run.

    ``position`` patches one position, ``head`` one head of an ``attn.hook_z``; neither patches all of it.

    Example:
        >>> corrupt = model.to_tokens("The cat sat on the mat. The cut")   # ``tokens`` with its last token changed
        >>> patched = patched_run(model, tokens, corrupt, "blocks.0.hook_resid_pre")   # the whole residual stream
        >>> torch.allclose(patched, model(tokens), atol=1e-5)
        True
    """
    clean, corrupt = patch_pair(model, clean_tokens, corrupt_tokens, clean_mask, corrupt_mask)
    model.layer_of(hook_name)  # an unknown name is an error naming it
    _, cache = model.run_with_cache(clean.tokens, attention_mask=clean.mask, names_filter=lambda name: name == hook_name)
    site, value = Site(hook_name, position, head), cache[hook_name]
    hook = lambda act, hook: site.write(act.clone(), value)
    return model.run_with_hooks(corrupt.tokens, attention_mask=corrupt.mask, return_type=return_type,
                                fwd_hooks=[(hook_name, hook)])


@dataclass(frozen=True)
class PatchingRun:
    """What every exact patching function takes besides its sites: the prompts, the metric and how to report."""

    clean: PromptBatch
    corrupt: PromptBatch
    metric: Metric
    per_prompt: bool
    progress: ProgressArg


def patching_run(model, clean_tokens, corrupt_tokens, answer_token, wrong_token, progress, metric, position,
                 per_prompt, clean_mask, corrupt_mask, padding_side) -> PatchingRun:
    """The prompts paired (``patch_pair``) and the metric chosen (``patching_metric``) for an exact patching run.

    Example:
        >>> run = patching_run(model, ["The cat"], ["The cut"], " s", " and", False, None, None, False, None, None, "right")
        >>> run.clean.size, type(run.metric).__name__
        (1, 'LogitDiff')
    """
    clean, corrupt = patch_pair(model, clean_tokens, corrupt_tokens, clean_mask, corrupt_mask, padding_side)
    return PatchingRun(clean, corrupt, patching_metric(model, clean.size, answer_token, wrong_token, metric, position),
                       per_prompt, progress)

