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
from typing import Callable, Sequence, Union

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from workbench.errors import InputError

Metric = Union[str, Callable[[Tensor, Tensor], Tensor]]

DEFAULT_TOKENS_PER_PASS = 16384  # variants x batch x pos per staircase chunk
LOGITS_BYTES_PER_PASS = 2**28  # unembed in sub-chunks of at most 256 MB of float32 logits


@dataclass(frozen=True)
class Edit:
    """Replace the activation at ``hook_name`` (inside block ``layer``) by ``apply(activation)``.

    ``apply`` receives this variant's rows [B, ...] (a clone it may write into) and returns them.
    """

    layer: int
    hook_name: str
    apply: Callable[[Tensor], Tensor]


def metric_per_variant(model, logits_nBPV: Tensor, tokens_BP: Tensor, metric: Metric) -> Float[Tensor, "n"]:
    """The metric of each of the n = len(logits) / B variants."""
    B = tokens_BP.shape[0]
    n = logits_nBPV.shape[0] // B
    if metric == "loss":
        P = tokens_BP.shape[1]
        targets = tokens_BP[:, 1:].repeat(n, 1)
        losses = F.cross_entropy(logits_nBPV[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none")
        return losses.view(n, B * (P - 1)).mean(1)
    if callable(metric):
        return torch.stack([torch.as_tensor(metric(logits_nBPV[i * B:(i + 1) * B], tokens_BP)).float().reshape(())
                            for i in range(n)])
    raise InputError(f"metric must be 'loss' or a callable (logits, tokens) -> scalar, got {metric!r}")


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
    order = sorted(range(len(edits)), key=lambda i: edits[i].layer)
    per_chunk = max(1, tokens_per_pass // (B * P))
    chunks = [order[i:i + per_chunk] for i in range(0, len(order), per_chunk)]
    unembed_variants = max(1, LOGITS_BYTES_PER_PASS // (4 * model.cfg.d_vocab * B * P))
    total = sum(L - edits[c[0]].layer + -(-len(c) // unembed_variants) for c in chunks)
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
            for start in range(0, len(chunk), unembed_variants):
                stop = min(start + unembed_variants, len(chunk))
                logits = model(resid[start * B:stop * B], start_at_layer=L)
                results[chunk[start:stop]] = metric_per_variant(model, logits, tokens_BP, metric).cpu()
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
