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
from typing import Callable, Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.metrics import Loss, Metric, PromptBatch, mean_over_scored, select_positions
from experiments.sites import Site
from workbench.errors import InputError

# Variants x batch x pos per staircase chunk: enough rows for full-speed GEMMs, few enough that the
# activations stay below glibc's mmap threshold (16384 took ~1.7M page faults, a 12% slower SmolLM2 sweep).
DEFAULT_TOKENS_PER_PASS = 2048
LOGITS_BYTES_PER_PASS = 2**28  # unembed in sub-chunks of at most 256 MB of float32 logits


@dataclass(frozen=True, eq=False)
class Edit:
    """Write ``value``'s slice at ``site`` into one variant's run (zeros when ``value`` is None).

    ``value`` is [B or 1, P, ...] like the activation; under the loss the variants run on P - 1
    positions and only the leading ones are read (see ``score_edits``).

    Example:
        >>> Edit(Site("blocks.1.attn.hook_z", index=0))            # zero-ablate head L1H0
        Edit(site=Site(hook_name='blocks.1.attn.hook_z', position=None, index=0), value=None)
    """

    site: Site
    value: Optional[Tensor] = None


def metric_from_final_resid(model, resid_nBPD: Tensor, batch: PromptBatch, metric: Metric) -> Float[Tensor, "n rows"]:
    """The metric of each of the n stacked variants of ``batch`` from the residual stream after the last block.

    The fast path: the loss comes tile by tile from the residual stream (``loss_from_resid``) and
    a metric reading one position per row unembeds only those positions (the unembedding is a
    third of a small model's FLOPs, nearly all spent on positions such a metric never reads).

    Example:
        >>> from experiments.metrics import prompt_batch
        >>> resid = cache["blocks.1.hook_resid_post"]                   # after toy-attn-2l's last block
        >>> values = metric_from_final_resid(model, torch.cat([resid, resid]), prompt_batch(model, tokens), Loss())
        >>> values.shape, torch.allclose(values, model(tokens, return_type="loss"))   # two variants, each the loss
        (torch.Size([2, 1]), True)
    """
    n = resid_nBPD.shape[0] // batch.size
    if isinstance(metric, Loss):
        Q = resid_nBPD.shape[1] - 1 if resid_nBPD.shape[1] == batch.tokens.shape[1] else resid_nBPD.shape[1]
        losses = model.loss_from_resid(resid_nBPD[:, :Q], batch.tokens[:, 1:Q + 1].repeat(n, 1))
        return mean_over_scored(losses, batch.repeat(n)).view(n, -1)
    if isinstance(metric.position, str) and metric.position == "all":
        return metric.per_prompt(model.logits_from_resid(resid_nBPD), batch).view(n, -1)
    resid_nBD = select_positions(resid_nBPD, batch, metric.position)  # unembed only the positions read
    return metric.per_prompt(model.logits_from_resid(resid_nBD[:, None])[:, 0], batch).view(n, -1)


def staircase_forward(model, resid_pre_by_layer: Sequence[Float[Tensor, "batch pos d_model"]], join_layers: Sequence[int],
                      mask_BP: Optional[Tensor] = None, hooks_at: Callable[[int, int], list] = lambda layer, row: [],
                      advance: Callable[[int], object] = lambda steps: None) -> Float[Tensor, "n_batch pos d_model"]:
    """The residual stream after the last block of n stacked variants of one batch, variant i entering block
    ``join_layers[i]`` (sorted) from the unedited run's ``resid_pre_by_layer`` there: each block runs once, on the
    variants that have reached it, and the blocks after the last joiner run in one call. ``hooks_at(layer, row)``
    gives the hooks of the block a variant joins (``row``: the first of the joiners' variant rows); hooks
    around the whole pass see each block's running variants, always the first ones of the stack. ``advance``
    is told how many blocks each step ran.

    Example:
        >>> from experiments.metrics import prompt_batch
        >>> _, resid_pre, _ = unedited_run(model, prompt_batch(model, tokens), Loss())
        >>> final = staircase_forward(model, resid_pre, [0, 1])         # no edit: both variants are the plain run
        >>> final.shape, torch.allclose(final[:1], final[1:], atol=1e-5)
        (torch.Size([2, 14, 128]), True)
    """
    L = model.cfg.n_layers
    first, last = join_layers[0], join_layers[-1]
    resid = resid_pre_by_layer[first][:0]
    n_rows = 0
    for layer in range(first, L):
        joining = sum(1 for j in join_layers if j == layer)
        if joining:
            resid = torch.cat([resid, resid_pre_by_layer[layer].repeat(joining, 1, 1)])
        hooks = hooks_at(layer, n_rows)
        n_rows += joining
        mask = None if mask_BP is None else mask_BP.repeat(n_rows, 1)
        with model.hooks(fwd_hooks=hooks):
            resid = model(resid, start_at_layer=layer, stop_at_layer=layer + 1, attention_mask=mask)
        advance(1)
        if layer >= last and layer + 1 < L:  # no more joiners: run the rest in one call
            resid = model(resid, start_at_layer=layer + 1, stop_at_layer=L, attention_mask=mask)
            advance(L - layer - 1)
            break
    return resid


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
    batch: PromptBatch,
    edits: Sequence[Edit],
    metric: Metric,
    progress: ProgressArg = False,
    tokens_per_pass: int = DEFAULT_TOKENS_PER_PASS,
    desc: str = "variants",
) -> Float[Tensor, "n_edits rows"]:
    """The metric of each prompt (rows: B, or 1 for a batch-level metric) under each edit, in input order.

    The batch's attention mask travels with every variant, so padded prompts score as they would alone.

    Example:
        >>> from experiments.metrics import prompt_batch
        >>> kill = lambda l, h: Edit(Site(f"blocks.{l}.attn.hook_z", index=h))
        >>> batch = prompt_batch(model, tokens)
        >>> _, resid_pre, _ = unedited_run(model, batch, Loss())
        >>> losses = score_edits(model, resid_pre, batch, [kill(0, 1), kill(1, 0)], Loss())
        >>> [round(loss, 2) for loss in losses[:, 0].tolist()]        # [edits, rows]: L0H1 and L1H0 zero-ablated
        [7.15, 5.12]
    """
    B, P = batch.tokens.shape
    L = model.cfg.n_layers
    layers = [model.layer_of(edit.site.hook_name) for edit in edits]
    if None in layers:
        raise InputError(f"edits must lie inside a block: {edits[layers.index(None)].site.hook_name!r} does not")
    # The loss reads no prediction from the last position and, attention being causal, no other
    # position sees it: the variants run without it (1/P less work, no loss term changes).
    run_P = P - 1 if isinstance(metric, Loss) else P
    resid_pre_by_layer = [resid_BPD[:, :run_P] for resid_BPD in resid_pre_by_layer]
    mask_BP = None if batch.mask is None else batch.mask[:, :run_P]
    order = sorted(range(len(edits)), key=lambda i: layers[i])
    per_chunk = max(1, tokens_per_pass // (B * run_P))
    chunks = [order[i:i + per_chunk] for i in range(0, len(order), per_chunk)]
    read_P = 1 if batch.positions(metric.position) is not None else P
    unembed_variants = max(1, LOGITS_BYTES_PER_PASS // (4 * model.cfg.d_vocab * B * read_P))
    unembed_steps = (lambda c: 1) if isinstance(metric, Loss) else (lambda c: -(-len(c) // unembed_variants))
    total = sum(L - layers[c[0]] + unembed_steps(c) for c in chunks)
    results: list[Optional[Tensor]] = [None] * len(edits)
    with Progress(progress, total=total, desc=desc) as bar:
        for chunk in chunks:
            def hooks_at(layer: int, first_row: int, chunk=chunk) -> list:  # the edits of the variants joining here
                by_hook: dict[str, list[tuple[int, Edit]]] = {}
                for row, i in enumerate((i for i in chunk if layers[i] == layer), start=first_row):
                    by_hook.setdefault(edits[i].site.hook_name, []).append((row, edits[i]))
                return [(name, _edit_hook(items, B)) for name, items in by_hook.items()]

            resid = staircase_forward(model, resid_pre_by_layer, [layers[i] for i in chunk], mask_BP, hooks_at,
                                      bar.advance)
            step = len(chunk) if isinstance(metric, Loss) else unembed_variants
            for start in range(0, len(chunk), step):
                stop = min(start + step, len(chunk))
                values = metric_from_final_resid(model, resid[start * B:stop * B], batch, metric).cpu()
                for i, row in zip(chunk[start:stop], values):
                    results[i] = row
                bar.advance()
    return torch.stack(results) if results else torch.empty(0, B)


@torch.no_grad()
def unedited_run(model, batch: PromptBatch, metric: Metric,
                 extra_hooks: Sequence[str] = ()) -> tuple[Float[Tensor, "rows"], list[Tensor], dict[str, Tensor]]:
    """The metric of each prompt in an unedited run, every layer's resid_pre and the activations at ``extra_hooks``.

    Example:
        >>> from experiments.metrics import prompt_batch
        >>> values, resid_pre, acts = unedited_run(model, prompt_batch(model, tokens), Loss(), ["blocks.0.attn.hook_z"])
        >>> len(resid_pre), acts["blocks.0.attn.hook_z"].shape        # each layer's resid_pre; the extra activation
        (2, torch.Size([1, 14, 4, 32]))
    """
    L = model.cfg.n_layers
    wanted = {f"blocks.{l}.hook_resid_pre" for l in range(L)} | {f"blocks.{L - 1}.hook_resid_post"} | set(extra_hooks)
    _, cache = model.run_with_cache(batch.tokens, attention_mask=batch.mask, return_type=None,
                                    names_filter=lambda name: name in wanted)
    values = metric_from_final_resid(model, cache[f"blocks.{L - 1}.hook_resid_post"], batch, metric)[0].cpu()
    resid_pre = [cache[f"blocks.{l}.hook_resid_pre"] for l in range(L)]
    return values, resid_pre, {name: cache[name] for name in extra_hooks}
