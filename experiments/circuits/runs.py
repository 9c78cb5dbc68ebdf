"""The runs every circuit method shares: the model switches, writer values, and a forward pass in
which chosen edges carry another run's values.

Legend: n variants in a batched pass, B batch, P position, O circuit writers, I circuit readers, H n_heads,
D d_model.

A patched pass stacks n variants of one batch (as ``experiments._batched`` does for head sweeps); variant v
rebuilds each reader's input as ``live input + sum over writers w with mask[v, p, w, r] of (source_w - live_w)``,
where ``live_w`` is what writer w wrote in this very pass and ``source_w`` comes from another run (clean values
to patch edges in; corrupted, mean or zero values to ablate them). With every edge into a reader in the mask,
the reader sees exactly the source run's input; with none, the pass is the unedited one.
"""

from __future__ import annotations

import bisect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from experiments._batched import DEFAULT_TOKENS_PER_PASS, metric_from_final_resid, staircase_forward
from experiments.circuits.graph import EMBED_HOOK, CircuitGraph
from experiments.metrics import Metric, MetricLike, PromptBatch
from experiments.patching.pairs import PairedPrompts
from workbench.call_lock import model_lock
from workbench.errors import InputError

DELTA_BYTES_PER_PASS = 2**28  # the patched pass's writer differences [n, B, P, used writers, D] stay under 256 MB


def paired_prompts(model, clean, corrupt=None, metric: Optional[MetricLike] = None,
                   clean_mask: Optional[Tensor] = None, corrupt_mask: Optional[Tensor] = None) -> PairedPrompts:
    """The older name of ``PairedPrompts.from_prompts`` for circuits: texts or token ids, or an ``IOIDataset`` as
    ``clean`` (its corrupted twins and, by default, logit[IO] - logit[S] at the last token as the metric).

    Example:
        >>> from experiments.datasets import ioi_dataset
        >>> data = paired_prompts(model, ioi_dataset(model, 3, names=["man", "one", "two", "time", "they"]))
        >>> data.size, type(data.metric).__name__
        (3, 'LogitDiff')
    """
    return PairedPrompts.from_prompts(model, clean, corrupt, metric=metric, clean_mask=clean_mask,
                                      corrupt_mask=corrupt_mask)


@contextmanager
def edge_switches(model) -> Iterator[None]:
    """Each head's own query, key and value input (``use_split_qkv_input``; a grouped-query model ungrouped, so a
    key or value input belongs to one query head) for the duration; the caller's switches come back after, even
    on an error. The switches change hook shapes model-wide, so the block holds the model's call lock
    (``workbench.call_lock``) from before they flip until after they are back: another thread's call waits
    rather than running, or caching, under them (the lock is re-entrant: this thread's own calls run).

    Example:
        >>> with edge_switches(model):
        ...     model.cfg.use_split_qkv_input
        True
        >>> model.cfg.use_split_qkv_input
        False"""
    with model_lock(model):
        saved = (model.cfg.use_split_qkv_input, model.cfg.ungroup_grouped_query_attention)
        try:
            model.set_use_split_qkv_input(True)
            if model.cfg.n_key_value_heads not in (None, model.cfg.n_heads):
                model.set_ungroup_grouped_query_attention(True)
            yield
        finally:
            model.set_use_split_qkv_input(saved[0])
            model.set_ungroup_grouped_query_attention(saved[1])


def writer_hooks(graph: CircuitGraph) -> list[str]:
    """The hook points holding every writer's output, in the order they run.

    Example:
        >>> from experiments.circuits.graph import circuit_graph
        >>> writer_hooks(circuit_graph(model))
        ['blocks.0.hook_resid_pre', 'blocks.0.attn.hook_result', 'blocks.1.attn.hook_result']"""
    return list(dict.fromkeys(graph.writer_site(w)[0] for w in range(len(graph.writers))))


def reader_hooks(graph: CircuitGraph) -> list[str]:
    """The hook points holding every reader's input, in the order they run.

    Example:
        >>> from experiments.circuits.graph import circuit_graph
        >>> reader_hooks(circuit_graph(model))[:3], reader_hooks(circuit_graph(model))[-1]
        (['blocks.0.hook_q_input', 'blocks.0.hook_k_input', 'blocks.0.hook_v_input'], 'blocks.1.hook_resid_post')"""
    return list(dict.fromkeys(graph.reader_site(r)[0] for r in range(len(graph.readers))))


@torch.no_grad()
def writer_values(model, graph: CircuitGraph, batch: PromptBatch) -> dict[str, Tensor]:
    """Every writer's output in an unedited run of ``batch``: {hook: [B, P, D] or [B, P, H, D] (heads)}.

    Example:
        >>> from experiments.circuits.graph import circuit_graph
        >>> from experiments.metrics import PromptBatch
        >>> values = writer_values(model, circuit_graph(model), PromptBatch(tokens))
        >>> values["blocks.1.attn.hook_result"].shape
        torch.Size([1, 14, 4, 128])"""
    wanted = set(writer_hooks(graph))
    _, cache = model.run_with_cache(batch.tokens, attention_mask=batch.mask, stop_at_layer=graph.n_layers,
                                    names_filter=lambda name: name in wanted)
    return {name: cache[name] for name in wanted}


def stack_writers(graph: CircuitGraph, values: dict[str, Tensor]) -> Float[Tensor, "batch pos writers d_model"]:
    """Writer outputs [B, P, O, D] in writer order from their hooks' values.

    Example:
        >>> from experiments.circuits.graph import circuit_graph
        >>> from experiments.metrics import PromptBatch
        >>> graph = circuit_graph(model)
        >>> stack_writers(graph, writer_values(model, graph, PromptBatch(tokens))).shape
        torch.Size([1, 14, 9, 128])"""
    parts = [values[EMBED_HOOK][:, :, None]]
    for layer in range(graph.n_layers):
        parts.append(values[f"blocks.{layer}.attn.hook_result"])
        if graph.has_mlp:
            parts.append(values[f"blocks.{layer}.hook_mlp_out"][:, :, None])
    return torch.cat(parts, dim=2)


@dataclass(frozen=True, eq=False)
class BaseRun:
    """The unedited run a patched pass edits: every layer's ``hook_resid_pre``, the last ``hook_resid_post`` and every
    writer's output, so a variant whose first edited reader sits in layer l starts at layer l (the staircase of
    ``experiments._batched``) and one editing only the logits reader runs no block at all."""

    resid_pre: list[Tensor]
    final: Tensor
    writers: dict[str, Tensor]


@torch.no_grad()
def base_run(model, graph: CircuitGraph, batch: PromptBatch) -> BaseRun:
    """The unedited run of ``batch`` a patched pass starts from (the edge switches on).

    Example:
        >>> from experiments.circuits.graph import circuit_graph
        >>> from experiments.metrics import PromptBatch
        >>> run = base_run(model, circuit_graph(model), PromptBatch(tokens))
        >>> len(run.resid_pre), run.final.shape
        (2, torch.Size([1, 14, 128]))"""
    L = graph.n_layers
    wanted = {f"blocks.{l}.hook_resid_pre" for l in range(L)} | {f"blocks.{L - 1}.hook_resid_post"}
    wanted |= set(writer_hooks(graph))
    # stop_at_layer: the blocks run and nothing is unembedded (return_type=None alone still unembeds)
    _, cache = model.run_with_cache(batch.tokens, attention_mask=batch.mask, stop_at_layer=L,
                                    names_filter=lambda name: name in wanted)
    return BaseRun([cache[f"blocks.{l}.hook_resid_pre"] for l in range(L)], cache[f"blocks.{L - 1}.hook_resid_post"],
                   {name: cache[name] for name in writer_hooks(graph)})


def _reader_layer(graph: CircuitGraph, r: int) -> int:
    return graph.n_layers if r == len(graph.readers) - 1 else r // (3 * graph.n_heads + int(graph.has_mlp))


def _writer_layer(graph: CircuitGraph, w: int) -> int:
    return -1 if w == 0 else (w - 1) // graph.per_layer_writers


def patched_metric(model, graph: CircuitGraph, base: PromptBatch, metric: Metric,
                   masks: Bool[Tensor, "n pos_or_1 writers readers"], sources: dict[str, Tensor],
                   start: Optional[BaseRun] = None) -> Float[Tensor, "n rows"]:
    """The metric of each row of ``base`` under each variant's edges carrying ``sources``. ``masks[v]`` is [P, O, I]
    (edges per position) or [1, O, I] (at every position); ``sources`` maps each writer hook to [B or 1, P, (H,) D]
    values. Variants run stacked as a staircase (``experiments._batched.staircase_forward``), each joining at the
    layer of its first edited reader (``start``: the unedited run, made here when not given); those editing only
    the logits reader run no block. The model's edge switches must be on (``edge_switches``).

    Example:
        >>> from experiments.circuits.graph import circuit_graph
        >>> from experiments.metrics import PromptBatch, as_metric
        >>> graph, batch = circuit_graph(model), PromptBatch(tokens)
        >>> metric = as_metric(lambda logits, tokens: logits[:, -1, 0])
        >>> with edge_switches(model):                                  # no edge, every edge from the same run
        ...     values = patched_metric(model, graph, batch, metric, as_variant_masks(graph, [graph.edge_mask * 0,
        ...                             graph.edge_mask]), writer_values(model, graph, batch))
        >>> torch.allclose(values[0], values[1], atol=1e-5)
        True
    """
    B, P = base.tokens.shape
    L = graph.n_layers
    start = start if start is not None else base_run(model, graph, base)
    reader_layers = torch.tensor([_reader_layer(graph, r) for r in range(len(graph.readers))])
    edited = masks.any(dim=(1, 2))  # [n, I]
    first = [int(reader_layers[row].min()) if bool(row.any()) else L for row in edited]
    order = sorted(range(len(masks)), key=first.__getitem__)
    out: list[Optional[Tensor]] = [None] * len(masks)
    # variants editing blocks share staircase passes; those editing only the logits reader share their own
    for variants in ([i for i in order if first[i] < L], [i for i in order if first[i] == L]):
        for chunk in _pass_chunks(masks, variants, B * P, model.cfg.d_model):
            values = _patched_pass(model, graph, base, metric, masks[chunk], [first[i] for i in chunk], sources, start)
            for j, row in zip(chunk, values):
                out[j] = row
    return torch.stack(out)


def _pass_chunks(masks: Bool[Tensor, "n pos_or_1 writers readers"], variants: list[int], tokens_per_variant: int,
                 d_model: int) -> list[list[int]]:
    """``variants`` in order, cut into passes of at most ``DEFAULT_TOKENS_PER_PASS`` tokens whose writer differences
    [n, B, P, writers the pass patches, D] stay under ``DELTA_BYTES_PER_PASS`` (one variant a pass at least)."""
    writers_nO = masks.any(dim=(1, 3))
    chunks: list[list[int]] = []
    chunk: list[int] = []
    used_O = torch.zeros(masks.shape[2], dtype=torch.bool)
    for v in variants:
        grown_O = used_O | writers_nO[v]
        tokens = (len(chunk) + 1) * tokens_per_variant
        if chunk and (tokens > DEFAULT_TOKENS_PER_PASS
                      or 4 * tokens * max(1, int(grown_O.sum())) * d_model > DELTA_BYTES_PER_PASS):
            chunks.append(chunk)
            chunk, grown_O = [], writers_nO[v]
        chunk.append(v)
        used_O = grown_O
    return chunks + [chunk] if chunk else chunks


@torch.no_grad()
def _patched_pass(model, graph: CircuitGraph, base: PromptBatch, metric: Metric, masks: Tensor, first_layers: list[int],
                  sources: dict[str, Tensor], start: BaseRun) -> Tensor:
    n, L = masks.shape[0], graph.n_layers
    hooks = patch_hooks(graph, base, masks, sources, start, first_layers)
    with model.hooks(fwd_hooks=hooks):
        if first_layers[0] < L:
            final = staircase_forward(model, start.resid_pre, first_layers, base.mask)
        else:  # only the logits reader is edited (or nothing): no block runs
            final = start.final.repeat(n, 1, 1)
            final_hook = dict(hooks).get(f"blocks.{L - 1}.hook_resid_post")
            final = final if final_hook is None else final_hook(final, None)
    # unembed only the positions the metric reads (the unembedding is a fifth of SmolLM2's forward)
    return metric_from_final_resid(model, final, base, metric).float().cpu()


def patch_hooks(graph: CircuitGraph, base: PromptBatch, masks: Bool[Tensor, "n pos_or_1 writers readers"],
                sources: dict[str, Tensor], start: BaseRun,
                first_layers: Union[int, Sequence[int]] = 0) -> list[tuple[str, object]]:
    """The forward hooks of a pass over n stacked copies of ``base`` in which variant v's masked edges carry
    ``sources``: writer hooks record (source - live) per patched writer, reader hooks add each variant's sum of them.
    Variant v enters the pass at block ``first_layers[v]`` (non-decreasing; one number for all), so a block's hooks
    see the variants that have reached it, the first ones of the stack; a writer before the block where a variant
    enters (the embedding always) takes its live value from ``start``.

    Example:
        >>> from experiments.circuits.graph import circuit_graph
        >>> from experiments.metrics import PromptBatch
        >>> graph, batch = circuit_graph(model), PromptBatch(tokens)
        >>> with edge_switches(model):
        ...     run = base_run(model, graph, batch)
        ...     hooks = patch_hooks(graph, batch, as_variant_masks(graph, graph.edge_mask), run.writers, run)
        >>> sorted({name.split(".")[-1] for name, _ in hooks})      # the embedding's value comes from the run
        ['hook_k_input', 'hook_q_input', 'hook_resid_post', 'hook_result', 'hook_v_input']
    """
    n = masks.shape[0]
    B, P = base.tokens.shape
    firsts_n = torch.tensor([first_layers] * n if isinstance(first_layers, int) else list(first_layers))
    if bool((firsts_n[1:] < firsts_n[:-1]).any()):
        raise InputError(f"first_layers must not decrease: the variants enter the pass in order, got {firsts_n.tolist()}")
    used = masks.any(dim=(0, 1, 3)).nonzero().flatten().tolist()  # writers some variant patches
    slot = {w: i for i, w in enumerate(used)}
    D = start.final.shape[-1]
    deltas = start.final.new_zeros(n, B, P, len(used), D)
    for w in used:  # the variants entering after the writer: the unedited run's values
        later_n = firsts_n > _writer_layer(graph, w)
        if bool(later_n.any()):
            name, head = graph.writer_site(w)
            live, src = start.writers[name], sources[name]
            if head is not None:
                live, src = live[:, :, head], src[:, :, head]
            deltas[later_n.to(deltas.device), :, :, slot[w]] = src.to(live.dtype) - live

    def write_hook(w_heads: list[tuple[int, Optional[int]]]):
        def hook(activation: Tensor, hook) -> None:
            view = activation.view(-1, B, *activation.shape[1:])  # the k variants that have reached this block
            source = sources[hook.name]
            for w, head in w_heads:
                live = view[:, :, :, head] if head is not None else view
                src = source[:, :, head] if head is not None else source
                deltas[:len(view), :, :, slot[w]] = src.to(live.dtype) - live
        return hook

    def read_hook(readers: list[int], heads: Optional[list[int]], feeding: list[int]):
        # Only the writers, variants and readers some patched edge reaches: a pass stacking many single edges gives
        # each reader hook a few (variant, reader) pairs, and summing every variant's differences from all the
        # pass's patched writers into every reader made 64 SmolLM2 edges take 6.7 s instead of 5.7 s. The masks
        # live on the CPU (the graph's bookkeeping); the pass runs where the model is.
        sub_nPur = masks[:, :, feeding][:, :, :, readers]
        variants = sub_nPur.any(dim=(1, 2, 3)).nonzero().flatten().tolist()
        kept_r = sub_nPur.any(dim=(0, 1, 2)).nonzero().flatten().tolist()
        sub_vPur = sub_nPur[variants][:, :, :, kept_r].to(deltas.device, deltas.dtype)
        sub_vPur = sub_vPur.expand(len(variants), P, *sub_vPur.shape[2:])
        slots_u = torch.tensor([slot[w] for w in feeding], device=deltas.device)
        variants_v = torch.tensor(variants, device=deltas.device)
        leading = variants == list(range(len(variants)))  # the first variants of the stack: plain slices
        heads_r = None if heads is None else torch.tensor([heads[r] for r in kept_r], device=deltas.device)

        def hook(activation: Tensor, hook) -> Tensor:
            view = activation.view(-1, B, *activation.shape[1:])
            c = bisect.bisect_left(variants, len(view))  # the variants of these that have reached this block
            if c == 0:
                return activation
            rows_vbpUd = deltas[:c] if leading else deltas.index_select(0, variants_v[:c])
            add_vbprd = torch.einsum("vbpud,vpur->vbprd", rows_vbpUd.index_select(3, slots_u),
                                     sub_vPur[:c].to(activation.dtype))
            out = view.clone()
            if heads_r is None:  # one reader: the MLP's input or the logits'
                out.index_add_(0, variants_v[:c], add_vbprd[:, :, :, 0])
            elif leading:
                out[:c, :, :, heads_r] += add_vbprd
            else:  # two index tensors apart: the indexed slice is [v, r, b, p, d]
                out[variants_v[:c, None], :, :, heads_r[None]] += add_vbprd.permute(0, 3, 1, 2, 4)
            return out.view(activation.shape)
        return hook

    hooks = []
    by_writer_hook: dict[str, list[tuple[int, Optional[int]]]] = {}
    for w in used:
        if _writer_layer(graph, w) >= int(firsts_n[0]):  # some variant runs the writer's block
            name, head = graph.writer_site(w)
            by_writer_hook.setdefault(name, []).append((w, head))
    hooks += [(name, write_hook(items)) for name, items in by_writer_hook.items()]
    by_reader_hook: dict[str, list[int]] = {}
    for r in range(len(graph.readers)):
        by_reader_hook.setdefault(graph.reader_site(r)[0], []).append(r)
    into_OI = masks.any(dim=(0, 1))  # [writers, readers]: some variant patches the edge
    for name, readers in by_reader_hook.items():
        # only the writers some variant patches into these readers: a pass stacking many single edges adds each
        # reader a few writers' differences, not every patched writer's
        fed_O = into_OI[:, readers].any(1).tolist()
        feeding = [w for w in used if fed_O[w]]
        if not feeding:
            continue
        heads = [graph.reader_site(r)[1] for r in readers]
        hooks.append((name, read_hook(readers, None if heads[0] is None else heads, feeding)))
    return hooks


def source_values(model, graph: CircuitGraph, batch: PromptBatch, kind: str) -> dict[str, Tensor]:
    """The values ablated edges carry: ``"corrupt"`` (the run of ``batch``), ``"mean"`` (its mean over the real
    tokens of every row at each position) or ``"zero"``.

    Example:
        >>> from experiments.circuits.graph import circuit_graph
        >>> from experiments.metrics import PromptBatch
        >>> source_values(model, circuit_graph(model), PromptBatch(tokens), "zero")["blocks.0.hook_resid_pre"].abs().sum()
        tensor(0.)"""
    values = writer_values(model, graph, batch)
    if kind == "corrupt":
        return values
    if kind == "zero":
        return {name: torch.zeros_like(value[:1]) for name, value in values.items()}
    if kind == "mean":
        mask = batch.mask if batch.mask is not None else torch.ones(batch.tokens.shape, dtype=torch.bool)
        weights = mask.to(device=values[EMBED_HOOK].device, dtype=values[EMBED_HOOK].dtype)
        means = {}
        for name, value in values.items():
            w = weights.view(*weights.shape, *([1] * (value.ndim - 2)))
            means[name] = ((value * w).sum(0, keepdim=True) / w.sum(0, keepdim=True).clamp_min(1))
        return means
    raise InputError(f"ablation must be 'corrupt', 'mean' or 'zero', got {kind!r}")


def as_variant_masks(graph: CircuitGraph, masks: Union[Tensor, Sequence[Tensor]]) -> Bool[Tensor, "n pos_or_1 writers readers"]:
    """Masks [O, I] or [P, O, I] (one, or a list of one shape) as [n, P or 1, O, I], restricted to the graph's edges.

    Example:
        >>> from experiments.circuits.graph import circuit_graph
        >>> graph = circuit_graph(model)
        >>> as_variant_masks(graph, graph.edge_mask).shape
        torch.Size([1, 1, 9, 25])"""
    stacked = torch.stack(list(masks)) if not isinstance(masks, Tensor) else masks[None]
    if stacked.ndim == 3:
        stacked = stacked[:, None]
    if stacked.shape[-2:] != graph.edge_mask.shape:
        raise InputError(f"edge masks must be [writers, readers] = {tuple(graph.edge_mask.shape)} (or with a position "
                         f"axis first), got {tuple(stacked.shape[-2:])}")
    return stacked.bool() & graph.edge_mask
