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

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from experiments._batched import metric_from_final_resid
from experiments.circuits.graph import EMBED_HOOK, CircuitGraph
from experiments.metrics import Metric, MetricLike, PromptBatch
from experiments.patching.pairs import PairedPrompts
from workbench.call_lock import model_lock
from workbench.errors import InputError

TOKENS_PER_PASS = 2048  # variants x batch x pos per patched pass
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
    values. Variants run stacked, each from the layer of its first edited reader (``start``: the unedited run, made
    here when not given). The model's edge switches must be on (``edge_switches``).

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
    start = start if start is not None else base_run(model, graph, base)
    reader_layers = torch.tensor([_reader_layer(graph, r) for r in range(len(graph.readers))])
    edited = masks.any(dim=(1, 2))  # [n, I]
    first = [int(reader_layers[row].min()) if bool(row.any()) else graph.n_layers for row in edited]
    out: list[Optional[Tensor]] = [None] * len(masks)
    for layer in sorted(set(first)):
        group = [i for i, f in enumerate(first) if f == layer]
        n_used = max(1, int(masks[group].any(dim=(0, 1, 3)).sum()))
        per_pass = max(1, min(TOKENS_PER_PASS // (B * P), DELTA_BYTES_PER_PASS // (4 * B * P * n_used * model.cfg.d_model)))
        for i in range(0, len(group), per_pass):
            chunk = group[i:i + per_pass]
            values = _patched_pass(model, graph, base, metric, masks[chunk], sources, start, layer)
            for j, row in zip(chunk, values):
                out[j] = row
    return torch.stack(out)


@torch.no_grad()
def _patched_pass(model, graph: CircuitGraph, base: PromptBatch, metric: Metric, masks: Tensor,
                  sources: dict[str, Tensor], start: BaseRun, first_layer: int) -> Tensor:
    n, L = masks.shape[0], graph.n_layers
    hooks = patch_hooks(graph, base, masks, sources, start, first_layer)
    mask = None if base.mask is None else base.mask.repeat(n, 1)
    with model.hooks(fwd_hooks=hooks):
        if first_layer == 0:
            final = model(base.tokens.repeat(n, 1), attention_mask=mask, stop_at_layer=L)
        elif first_layer < L:
            final = model(start.resid_pre[first_layer].repeat(n, 1, 1), start_at_layer=first_layer, stop_at_layer=L,
                          attention_mask=mask)
        else:  # only the logits reader is edited (or nothing): no block runs
            final = start.final.repeat(n, 1, 1)
            final_hook = dict(hooks).get(f"blocks.{L - 1}.hook_resid_post")
            final = final if final_hook is None else final_hook(final, None)
    # unembed only the positions the metric reads (the unembedding is a fifth of SmolLM2's forward)
    return metric_from_final_resid(model, final, base, metric).float().cpu()


def patch_hooks(graph: CircuitGraph, base: PromptBatch, masks: Bool[Tensor, "n pos_or_1 writers readers"],
                sources: dict[str, Tensor], start: BaseRun, first_layer: int = 0) -> list[tuple[str, object]]:
    """The forward hooks of a pass over n stacked copies of ``base`` in which variant v's masked edges carry
    ``sources``: writer hooks record (source - live) per patched writer, reader hooks add each variant's sum of them.
    Writers before ``first_layer`` (where the pass starts) and the embedding take their live value from ``start``.

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
    used = masks.any(dim=(0, 1, 3)).nonzero().flatten().tolist()  # writers some variant patches
    slot = {w: i for i, w in enumerate(used)}
    D = start.final.shape[-1]
    deltas = start.final.new_zeros(n, B, P, len(used), D)
    for w in used:  # writers before the first block run: the unedited run's values
        if _writer_layer(graph, w) < first_layer:
            name, head = graph.writer_site(w)
            live, src = start.writers[name], sources[name]
            if head is not None:
                live, src = live[:, :, head], src[:, :, head]
            deltas[:, :, :, slot[w]] = src.to(live.dtype) - live

    def write_hook(w_heads: list[tuple[int, Optional[int]]]):
        def hook(activation: Tensor, hook) -> None:
            view = activation.view(n, B, *activation.shape[1:])
            source = sources[hook.name]
            for w, head in w_heads:
                live = view[:, :, :, head] if head is not None else view
                src = source[:, :, head] if head is not None else source
                deltas[:, :, :, slot[w]] = src.to(live.dtype) - live
        return hook

    def read_hook(readers: list[int], heads: Optional[list[int]], feeding: list[int]):
        # the masks live on the CPU (the graph's bookkeeping); the pass runs where the model is
        sub = masks[:, :, feeding][:, :, :, readers].to(deltas.device, deltas.dtype)  # [n, P|1, u, r]
        sub = sub.expand(n, P, *sub.shape[2:])
        slots = torch.tensor([slot[w] for w in feeding], device=deltas.device)

        def hook(activation: Tensor, hook) -> Tensor:
            add = torch.einsum("nbpud,npur->nbprd", deltas[:, :, :, slots], sub.to(activation.dtype))
            view = activation.view(n, B, *activation.shape[1:])
            if heads is None:
                return (view + add[:, :, :, 0]).view(activation.shape)
            out = view.clone()
            out[:, :, :, heads] += add
            return out.view(activation.shape)
        return hook

    hooks = []
    by_writer_hook: dict[str, list[tuple[int, Optional[int]]]] = {}
    for w in used:
        if _writer_layer(graph, w) >= first_layer:
            name, head = graph.writer_site(w)
            by_writer_hook.setdefault(name, []).append((w, head))
    hooks += [(name, write_hook(items)) for name, items in by_writer_hook.items()]
    by_reader_hook: dict[str, list[int]] = {}
    for r in range(len(graph.readers)):
        by_reader_hook.setdefault(graph.reader_site(r)[0], []).append(r)
    for name, readers in by_reader_hook.items():
        feeding = [w for w in used if w < int(graph.n_before[readers[0]])]
        if not feeding or not bool(masks[:, :, feeding][:, :, :, readers].any()):
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
