"""Scoring many single-layer edits of one run in a few batched forward passes.

Legend: B batch, P position, D d_model, V d_vocab, n edits (variants) in a pass.

An ``Edit`` changes one activation inside block ``layer`` (a head's z, a position of the
residual stream, ...). Everything before that block is the same as in the unedited run, so
the edit's forward starts from the cached ``resid_pre`` of its layer (``Decoder.forward``'s
``start_at_layer``). Edits are sorted by layer and run as a staircase: the batch enters block
a with the edits of layer a, the edits of layer a+1 join it at block a+1, and so on, so each
block runs once per chunk on every variant that has reached it, and the unembedding runs on
large batches. Chunks keep a pass under ``tokens_per_pass`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from workbench.errors import InputError
from workbench.model import next_token_loss

Metric = Union[str, Callable[[Tensor, Tensor], Tensor]]

# Variants x batch x pos per staircase chunk: enough rows for full-speed GEMMs, few enough that the
# activations stay below glibc's mmap threshold (16384 took ~1.7M page faults, a 12% slower SmolLM2 sweep).
DEFAULT_TOKENS_PER_PASS = 2048
LOGITS_BYTES_PER_PASS = 2**28  # unembed in sub-chunks of at most 256 MB of float32 logits
LOSS_ROWS, LOSS_VOCAB = 2048, 1024  # the loss's logits tiles: 8 MB, which stay in this CPU's caches


@dataclass(frozen=True)
class Edit:
    """Replace the activation at ``hook_name`` (inside block ``layer``) by ``apply(activation)``.

    ``apply`` receives this variant's rows [B, P', ...] (a clone it may write into) and returns
    them. P' is the input's P, or P - 1 under the "loss" metric (see ``score_edits``).
    """

    layer: int
    hook_name: str
    apply: Callable[[Tensor], Tensor]


class PositionMetric:
    """A metric that reads one position's logits: ``from_logits(logits [B, V], tokens) -> scalar``.

    Called like any metric, ``(logits [B, P, V], tokens)``. ``score_edits`` unembeds only that
    position for it: the unembedding is a third of a small model's FLOPs, nearly all spent on
    positions such a metric never reads.
    """

    position: int

    def from_logits(self, logits_BV: Tensor, tokens_BP: Optional[Tensor]) -> Tensor:
        raise NotImplementedError

    def __call__(self, logits_BPV: Tensor, tokens_BP: Optional[Tensor] = None) -> Tensor:
        return self.from_logits(logits_BPV[:, self.position], tokens_BP)


def metric_per_variant(model, logits_nBPV: Tensor, tokens_BP: Tensor, metric: Metric) -> Float[Tensor, "n"]:
    """The metric of each of the n = len(logits) / B variants."""
    B = tokens_BP.shape[0]
    n = logits_nBPV.shape[0] // B
    if metric == "loss":
        return next_token_loss(logits_nBPV, tokens_BP.repeat(n, 1), per_token=True).view(n, -1).mean(1)
    if callable(metric):
        return torch.stack([torch.as_tensor(metric(logits_nBPV[i * B:(i + 1) * B], tokens_BP)).float().reshape(())
                            for i in range(n)])
    raise InputError(f"metric must be 'loss' or a callable (logits, tokens) -> scalar, got {metric!r}")


def _mean_loss_from_final_resid(model, resid_nBQD: Tensor, tokens_BP: Tensor) -> Float[Tensor, "n"]:
    """Mean next-token loss of each variant from its residual stream after the last block at
    positions Q = 0 .. P-2.

    Equal to the loss of ``model(resid, start_at_layer=n_layers)``'s logits (within float
    rounding), but the logits are made one cache-sized tile at a time (LOSS_ROWS positions x
    LOSS_VOCAB tokens), each tile giving its log-sum-exp and any target logits it holds. A
    full-width logits row block runs the unembedding GEMM ~1.25x slower here, spilling to memory.
    """
    B, P = tokens_BP.shape
    n = resid_nBQD.shape[0] // B
    normed_nBQD = model.ln_final(resid_nBQD) if model.ln_final is not None else resid_nBQD
    normed_MD = normed_nBQD.reshape(-1, normed_nBQD.shape[-1])
    W_U_VD = model.unembed.W_U
    targets_M = tokens_BP[:, 1:].repeat(n, 1).flatten()
    losses_M = torch.empty(len(targets_M), device=normed_MD.device)
    for row in range(0, len(targets_M), LOSS_ROWS):
        x_RD, targets_R = normed_MD[row:row + LOSS_ROWS], targets_M[row:row + LOSS_ROWS]
        target_logit_R = torch.empty(len(targets_R), device=normed_MD.device)
        tile_lse = []
        for col in range(0, W_U_VD.shape[0], LOSS_VOCAB):
            logits_RC = F.linear(x_RD, W_U_VD[col:col + LOSS_VOCAB]).float()  # as the model's logits, then float
            tile_lse.append(torch.logsumexp(logits_RC, -1))
            here = (targets_R >= col) & (targets_R < col + logits_RC.shape[1])
            target_logit_R[here] = logits_RC[here, targets_R[here] - col]
        losses_M[row:row + LOSS_ROWS] = torch.logsumexp(torch.stack(tile_lse, -1), -1) - target_logit_R
    return losses_M.view(n, B * (P - 1)).mean(1)


def _metric_from_final_resid(model, resid_nBPD: Tensor, tokens_BP: Tensor, metric: Metric) -> Float[Tensor, "n"]:
    """A callable metric of each variant from its residual stream after the last block."""
    if not isinstance(metric, PositionMetric):
        return metric_per_variant(model, model(resid_nBPD, start_at_layer=model.cfg.n_layers), tokens_BP, metric)
    position = metric.position % resid_nBPD.shape[1]
    logits_nB1V = model(resid_nBPD[:, position:position + 1], start_at_layer=model.cfg.n_layers)
    read_the_one_position = lambda logits_B1V, tokens: metric.from_logits(logits_B1V[:, 0], tokens)
    return metric_per_variant(model, logits_nB1V, tokens_BP, read_the_one_position)


def _edit_hook(edits_with_rows: list[tuple[int, Edit]], B: int):
    """One hook applying several variants' edits, each to its own block of B rows."""
    def hook(activation: Tensor, hook) -> Tensor:
        activation = activation.clone()
        for row, edit in edits_with_rows:
            activation[row * B:(row + 1) * B] = edit.apply(activation[row * B:(row + 1) * B])
        return activation

    return hook


@torch.no_grad()
def score_edits(
    model,
    resid_pre_by_layer: Sequence[Float[Tensor, "batch pos d_model"]],
    tokens_BP: Int[Tensor, "batch pos"],
    edits: Sequence[Edit],
    metric: Metric = "loss",
    progress: ProgressArg = False,
    tokens_per_pass: int = DEFAULT_TOKENS_PER_PASS,
    desc: str = "variants",
) -> Float[Tensor, "n_edits"]:
    """The metric of the model's output under each edit (one edit per variant), in input order.

    Example:
        >>> kill = lambda l, h: Edit(l, f"blocks.{l}.attn.hook_z", lambda z: z.index_fill(2, torch.tensor([h]), 0))
        >>> losses = score_edits(model, resid_pre, tokens, [kill(0, 1), kill(1, 0)])   # doctest: +SKIP
    """
    B, P = tokens_BP.shape
    L = model.cfg.n_layers
    # The loss reads no prediction from the last position and, attention being causal, no other
    # position sees it: the variants run without it (1/P less work, no loss term changes).
    run_P = P - 1 if metric == "loss" else P
    resid_pre_by_layer = [resid_BPD[:, :run_P] for resid_BPD in resid_pre_by_layer]
    order = sorted(range(len(edits)), key=lambda i: edits[i].layer)
    per_chunk = max(1, tokens_per_pass // (B * run_P))
    chunks = [order[i:i + per_chunk] for i in range(0, len(order), per_chunk)]
    unembed_variants = max(1, LOGITS_BYTES_PER_PASS // (4 * model.cfg.d_vocab * B * P))
    unembed_steps = (lambda c: 1) if metric == "loss" else (lambda c: -(-len(c) // unembed_variants))
    total = sum(L - edits[c[0]].layer + unembed_steps(c) for c in chunks)
    results = torch.empty(len(edits))
    with Progress(progress, total=total, desc=desc) as bar:
        for chunk in chunks:
            first, last = edits[chunk[0]].layer, edits[chunk[-1]].layer
            resid = resid_pre_by_layer[first][:0]
            n_rows = 0
            for layer in range(first, L):
                joining = [i for i in chunk if edits[i].layer == layer]
                if joining:
                    resid = torch.cat([resid, resid_pre_by_layer[layer].repeat(len(joining), 1, 1)])
                by_hook: dict[str, list[tuple[int, Edit]]] = {}
                for row, i in enumerate(joining, start=n_rows):
                    by_hook.setdefault(edits[i].hook_name, []).append((row, edits[i]))
                n_rows += len(joining)
                hooks = [(name, _edit_hook(items, B)) for name, items in by_hook.items()]
                with model.hooks(fwd_hooks=hooks):
                    resid = model(resid, start_at_layer=layer, stop_at_layer=layer + 1)
                bar.advance()
                if layer >= last and layer + 1 < L:  # no more joiners: run the rest in one call
                    resid = model(resid, start_at_layer=layer + 1, stop_at_layer=L)
                    bar.advance(L - layer - 1)
                    break
            if metric == "loss":
                results[chunk] = _mean_loss_from_final_resid(model, resid, tokens_BP).cpu()
                bar.advance()
                continue
            for start in range(0, len(chunk), unembed_variants):
                stop = min(start + unembed_variants, len(chunk))
                results[chunk[start:stop]] = _metric_from_final_resid(model, resid[start * B:stop * B], tokens_BP,
                                                                      metric).cpu()
                bar.advance()
    return results


@torch.no_grad()
def clean_run(model, tokens_BP: Tensor, metric: Metric, extra_hooks: Sequence[str] = ()) -> tuple[float, list[Tensor], dict[str, Tensor]]:
    """The unedited metric, every layer's resid_pre and the activations at ``extra_hooks``.

    Example:
        >>> clean_metric, resid_pre, acts = clean_run(model, tokens, "loss", ["blocks.0.attn.hook_z"])   # doctest: +SKIP
    """
    wanted = {f"blocks.{l}.hook_resid_pre" for l in range(model.cfg.n_layers)} | set(extra_hooks)
    logits, cache = model.run_with_cache(tokens_BP, names_filter=lambda name: name in wanted)
    value = float(metric_per_variant(model, logits, tokens_BP, metric)[0])
    resid_pre = [cache[f"blocks.{l}.hook_resid_pre"] for l in range(model.cfg.n_layers)]
    return value, resid_pre, {name: cache[name] for name in extra_hooks}
