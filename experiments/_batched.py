"""Scoring many single-layer edits of one run in a few batched forward passes.

Legend: B batch, P position, D d_model, V d_vocab, n variants in a batched pass.

An ``Edit`` writes a value into one ``Site`` (a head's z, a position of the residual stream,
...), which lies inside one block (``Decoder.layer_of``). Everything before that block is the
same as in the unedited run, so the edit's forward starts from the cached ``resid_pre`` of its
layer (``Decoder.forward``'s ``start_at_layer``). Edits are sorted by layer and run as a staircase: the batch enters block
a with the edits of layer a, the edits of layer a+1 join it at block a+1, and so on, so each
block runs once per chunk on every variant that has reached it, and the unembedding runs on
large batches. Chunks keep a pass under ``tokens_per_pass`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.sites import Site
from workbench.errors import InputError

Metric = Union[str, Callable[[Tensor, Tensor], Tensor]]

# Variants x batch x pos per staircase chunk: enough rows for full-speed GEMMs, few enough that the
# activations stay below glibc's mmap threshold (16384 took ~1.7M page faults, a 12% slower SmolLM2 sweep).
DEFAULT_TOKENS_PER_PASS = 2048
LOGITS_BYTES_PER_PASS = 2**28  # unembed in sub-chunks of at most 256 MB of float32 logits


@dataclass(frozen=True, eq=False)
class Edit:
    """Write ``value``'s slice at ``site`` into one variant's run (zeros when ``value`` is None).

    ``value`` is [B or 1, P, ...] like the activation; under the "loss" metric the variants run
    on P - 1 positions and only the leading ones are read (see ``score_edits``).

    Example:
        >>> Edit(Site("blocks.1.attn.hook_z", index=0))            # zero-ablate head L1H0
        Edit(site=Site(hook_name='blocks.1.attn.hook_z', position=None, index=0), value=None)
    """

    site: Site
    value: Optional[Tensor] = None


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
    """The metric of each of the n = len(logits) / B variants ("loss" is the model's ``loss_fn``).

    Example:
        >>> metric_per_variant(model, torch.cat([logits, logits]), tokens, "loss")   # two equal values   # doctest: +SKIP
    """
    B = tokens_BP.shape[0]
    n = logits_nBPV.shape[0] // B
    if metric == "loss":
        return model.loss_fn(logits_nBPV, tokens_BP.repeat(n, 1), per_token=True).view(n, -1).mean(1)
    if callable(metric):
        return torch.stack([torch.as_tensor(metric(logits_nBPV[i * B:(i + 1) * B], tokens_BP)).float().reshape(())
                            for i in range(n)])
    raise InputError(f"metric must be 'loss' or a callable (logits, tokens) -> scalar, got {metric!r}")


def _mean_loss_from_final_resid(model, resid_nBQD: Tensor, tokens_BP: Tensor) -> Float[Tensor, "n"]:
    """Mean next-token loss of each variant from its residual stream after the last block at
    positions 0 .. P-2 (the model's ``loss_from_resid``, which never holds the whole logits)."""
    n = resid_nBQD.shape[0] // tokens_BP.shape[0]
    return model.loss_from_resid(resid_nBQD, tokens_BP[:, 1:].repeat(n, 1)).view(n, -1).mean(1)


def _metric_from_final_resid(model, resid_nBPD: Tensor, tokens_BP: Tensor, metric: Metric) -> Float[Tensor, "n"]:
    """A callable metric of each variant from its residual stream after the last block."""
    if not isinstance(metric, PositionMetric):
        return metric_per_variant(model, model.logits_from_resid(resid_nBPD), tokens_BP, metric)
    position = metric.position % resid_nBPD.shape[1]
    logits_nB1V = model.logits_from_resid(resid_nBPD[:, position:position + 1])
    read_the_one_position = lambda logits_B1V, tokens: metric.from_logits(logits_B1V[:, 0], tokens)
    return metric_per_variant(model, logits_nB1V, tokens_BP, read_the_one_position)


def _edit_hook(edits_with_rows: list[tuple[int, Edit]], B: int):
    """One hook applying several variants' edits, each to its own block of B rows."""
    def hook(activation: Tensor, hook) -> Tensor:
        activation = activation.clone()
        for row, edit in edits_with_rows:
            edit.site.write(activation[row * B:(row + 1) * B], edit.value)
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
        >>> kill = lambda l, h: Edit(Site(f"blocks.{l}.attn.hook_z", index=h))
        >>> losses = score_edits(model, resid_pre, tokens, [kill(0, 1), kill(1, 0)])   # doctest: +SKIP
    """
    B, P = tokens_BP.shape
    L = model.cfg.n_layers
    layers = [model.layer_of(edit.site.hook_name) for edit in edits]
    if None in layers:
        raise InputError(f"edits must lie inside a block: {edits[layers.index(None)].site.hook_name!r} does not")
    # The loss reads no prediction from the last position and, attention being causal, no other
    # position sees it: the variants run without it (1/P less work, no loss term changes).
    run_P = P - 1 if metric == "loss" else P
    resid_pre_by_layer = [resid_BPD[:, :run_P] for resid_BPD in resid_pre_by_layer]
    order = sorted(range(len(edits)), key=lambda i: layers[i])
    per_chunk = max(1, tokens_per_pass // (B * run_P))
    chunks = [order[i:i + per_chunk] for i in range(0, len(order), per_chunk)]
    unembed_variants = max(1, LOGITS_BYTES_PER_PASS // (4 * model.cfg.d_vocab * B * P))
    unembed_steps = (lambda c: 1) if metric == "loss" else (lambda c: -(-len(c) // unembed_variants))
    total = sum(L - layers[c[0]] + unembed_steps(c) for c in chunks)
    results = torch.empty(len(edits))
    with Progress(progress, total=total, desc=desc) as bar:
        for chunk in chunks:
            first, last = layers[chunk[0]], layers[chunk[-1]]
            resid = resid_pre_by_layer[first][:0]
            n_rows = 0
            for layer in range(first, L):
                joining = [i for i in chunk if layers[i] == layer]
                if joining:
                    resid = torch.cat([resid, resid_pre_by_layer[layer].repeat(len(joining), 1, 1)])
                by_hook: dict[str, list[tuple[int, Edit]]] = {}
                for row, i in enumerate(joining, start=n_rows):
                    by_hook.setdefault(edits[i].site.hook_name, []).append((row, edits[i]))
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
def unedited_run(model, tokens_BP: Tensor, metric: Metric,
                 extra_hooks: Sequence[str] = ()) -> tuple[float, list[Tensor], dict[str, Tensor]]:
    """The metric of an unedited run of ``tokens``, every layer's resid_pre and the activations at ``extra_hooks``.

    Example:
        >>> value, resid_pre, acts = unedited_run(model, tokens, "loss", ["blocks.0.attn.hook_z"])   # doctest: +SKIP
    """
    wanted = {f"blocks.{l}.hook_resid_pre" for l in range(model.cfg.n_layers)} | set(extra_hooks)
    logits, cache = model.run_with_cache(tokens_BP, names_filter=lambda name: name in wanted)
    value = float(metric_per_variant(model, logits, tokens_BP, metric)[0])
    resid_pre = [cache[f"blocks.{l}.hook_resid_pre"] for l in range(model.cfg.n_layers)]
    return value, resid_pre, {name: cache[name] for name in extra_hooks}
