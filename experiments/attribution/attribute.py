"""``attribute``: the attribution graph of one prompt, circuit-tracer 0.5's algorithm on our model's public hooks.

Phases (its ``attribution/attribute.py``), on one ``ReplacementModel`` (``replacement.py``): read every source
(``ReplacementModel.read_sources``); run the frozen, linearised forward pass once for ``batch_size`` copies of the prompt; pick the logit nodes; one backward pass per
``batch_size`` logit nodes, then per ``batch_size`` features. With ``max_feature_nodes`` below the number of
active features, features are visited in order of their influence on the logits through the rows computed so
far, re-ranked every ``update_interval`` batches, and only the visited ones become nodes.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
from jaxtyping import Int
from torch import Tensor

from experiments._progress import Progress, ProgressArg
from experiments.attribution.graph import AttributionGraph
from experiments.attribution.influence import compute_partial_influences
from experiments.attribution.linearised import LinearisedForward
from experiments.attribution.plan import FORWARD_MEMORY, forward_copies
from experiments.attribution.replacement import ReplacementModel
from experiments.attribution.targets import salient_logits
from workbench.errors import InputError
from workbench.transcoders import TranscoderSet

Prompt = Union[str, Sequence[int], Tensor]


def attribute(model: Any, transcoders: Optional[TranscoderSet], prompt: Prompt, max_n_logits: int = 10,
              desired_logit_prob: float = 0.95, max_feature_nodes: Optional[int] = None, batch_size: int = 256,
              progress: ProgressArg = True, update_interval: int = 4,
              forward_memory: Optional[int] = FORWARD_MEMORY) -> AttributionGraph:
    """The attribution graph of ``prompt`` (text, or token ids; a special token is put first when the prompt does
    not start with one, as circuit-tracer does) through ``transcoders`` replacing ``model``'s MLPs (or through a
    ``ReplacementModel`` passed as ``model``, ``transcoders`` then None).

    ``batch_size`` targets share a backward pass, as in circuit-tracer, but the frozen forward pass keeps only as
    many copies of the prompt as fit in ``forward_memory`` bytes (256 MiB by default; ``None``: ``batch_size``
    copies), so a long prompt runs in bounded memory with the same graph (``plan.forward_copies``).

    Example (a one-layer model whose own MLP is its transcoder):
        >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, act_fn="relu"))
        >>> tc = wb.TranscoderSet(W_enc=[tiny.W_in[0].T.detach()], b_enc=[tiny.b_in[0].detach()], threshold=[None],
        ...     W_dec=[tiny.W_out[0][:, None].detach()], b_dec=tiny.b_out.detach(), feature_input_hook="mlp.hook_in",
        ...     feature_output_hook="mlp.hook_out")
        >>> graph = attribute(tiny, tc, [1, 2, 3], max_n_logits=2, progress=False)
        >>> graph.n_pos, len(graph.logit_token_ids), graph.n_nodes == len(graph.selected_features) + 2 * 3 + 2
        (3, 2, True)
        >>> attribute(model, None, "The cat")
        Traceback (most recent call last):
        workbench.errors.InputError: attribute needs a wb.TranscoderSet (wb.load_transcoders), got NoneType
    """
    for name, value in (("max_n_logits", max_n_logits), ("batch_size", batch_size), ("update_interval", update_interval)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    if not 0.0 < desired_logit_prob <= 1.0:
        raise InputError(f"desired_logit_prob must be in (0, 1], got {desired_logit_prob!r}")
    if max_feature_nodes is not None and (not isinstance(max_feature_nodes, int) or max_feature_nodes < 1):
        raise InputError(f"max_feature_nodes must be a positive integer or None, got {max_feature_nodes!r}")
    replacement = ReplacementModel.of(model, transcoders, caller="attribute")
    model, tc = replacement.model, replacement.transcoders
    tokens = prompt_tokens(model, prompt)
    copies = forward_copies(model, tc, tokens.shape[0], batch_size, forward_memory)
    sources = replacement.read_sources(tokens)
    n_active, n_layers, n_pos = sources.active_features.shape[0], tc.n_layers, tokens.shape[0]
    targets = salient_logits(sources.logits, model.W_U, max_n_logits, desired_logit_prob)
    n_logits = len(targets.token_ids)
    n_features = min(max_feature_nodes or n_active, n_active)
    logit_offset = n_active + (n_layers + 1) * n_pos
    forward = LinearisedForward(replacement, None, tokens, sources, copies)

    n_nodes = n_features + (n_layers + 1) * n_pos + n_logits
    adjacency = torch.zeros(n_nodes, n_nodes)
    # With every feature a node, rows go straight into the adjacency (feature i is node i). With fewer nodes
    # than active features, rows go into an edge buffer [visited + logits, active + errors + tokens + logits]
    # (its rows rank the features by influence), copied into the adjacency at the end.
    limited = n_features < n_active
    edges = torch.zeros(n_features + n_logits, logit_offset + n_logits) if limited else adjacency
    row_node = torch.zeros(n_features + n_logits, dtype=torch.long)
    with Progress(progress, total=n_logits + n_features, desc="attribution") as bar:
        for start in range(0, n_logits, batch_size):
            vectors = targets.vectors[start:start + batch_size]
            k = vectors.shape[0]
            rows = forward.rows(torch.full((k,), n_layers), torch.full((k,), n_pos - 1), vectors).float().cpu()
            if limited:
                edges[start:start + k, :logit_offset] = rows
            else:
                adjacency[n_nodes - n_logits + start:n_nodes - n_logits + start + k, :logit_offset] = rows
            row_node[start:start + k] = torch.arange(start, start + k) + logit_offset
            bar.advance(k)
        visited = _visit_features(forward, sources, edges if limited else None, adjacency, row_node,
                                  targets.probabilities.cpu(), n_logits, n_features, batch_size, update_interval, bar)
    del forward
    selected = torch.where(visited)[0]
    if limited:
        columns = torch.cat([selected, torch.arange(n_active, edges.shape[1])])
        order = row_node.argsort()   # visited features by index, then the logits
        for start in range(0, len(order), 1024):   # a block of rows at a time: no second full-size copy
            rows, places = order[start:start + 1024], torch.arange(start, min(start + 1024, len(order)))
            node = torch.where(places < n_features, places, places + (n_layers + 1) * n_pos)
            adjacency[node] = edges[rows][:, columns]
        del edges
    tokenizer = getattr(model, "tokenizer", None)
    decode = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else (lambda ids: " ".join(map(str, ids)))
    return AttributionGraph(
        input_string=decode(tokens.tolist()), input_tokens=tokens.cpu(), active_features=sources.active_features.cpu(),
        activation_values=sources.activation_values.float().cpu(), selected_features=selected,
        adjacency_matrix=adjacency, logit_token_ids=targets.token_ids.cpu(),
        logit_probabilities=targets.probabilities.cpu(), n_layers=n_layers, vocab_size=sources.logits.shape[0],
        logit_token_strings=[decode([i]) for i in targets.token_ids.tolist()],
        input_token_strings=[decode([i]) for i in tokens.tolist()], scan=replacement.scan)


def _visit_features(forward: LinearisedForward, sources: Any, edges: Optional[Tensor], adjacency: Tensor,
                    row_node: Tensor, logit_p: Tensor, n_logits: int, n_features: int, batch_size: int,
                    update_interval: int, bar: Progress) -> Tensor:
    """Computes a row per visited feature: every active feature straight into ``adjacency`` (``edges`` None), or
    the ``n_features`` most influential into ``edges`` (re-ranked every ``update_interval`` batches by their
    influence through the rows so far); returns the visited mask."""
    n_active = sources.active_features.shape[0]
    layers, positions = sources.active_features[:, 0], sources.active_features[:, 1]
    visited = torch.zeros(n_active, dtype=torch.bool)
    row, n_visited = n_logits, 0
    while n_visited < n_features:
        if edges is None:
            pending = torch.arange(n_active)
        else:
            influences = compute_partial_influences(edges[:row], logit_p, row_node[:row])
            rank = torch.argsort(influences[:n_active], descending=True)
            pending = rank[~visited[rank]][:min(update_interval * batch_size, n_features - n_visited)]
        for start in range(0, len(pending), batch_size):
            batch = pending[start:start + batch_size]
            n_visited += len(batch)
            rows = forward.rows(layers[batch], positions[batch], sources.encoder_vecs[batch],
                                retain_graph=n_visited < n_features).float().cpu()
            if edges is None:
                adjacency[batch, :rows.shape[1]] = rows
            else:
                edges[row:row + len(batch), :rows.shape[1]] = rows
            row_node[row:row + len(batch)] = batch
            visited[batch] = True
            row += len(batch)
            bar.advance(len(batch))
    return visited


def prompt_tokens(model: Any, prompt: Prompt) -> Int[Tensor, "pos"]:
    """The prompt's token ids ``[pos]``, starting with a special token (the BOS is put first unless the prompt
    starts with one), checked against the vocabulary and the context.

    Example:
        >>> prompt_tokens(model, [0] * 10_000)
        Traceback (most recent call last):
        workbench.errors.InputError: the prompt has 10000 tokens, more than the model's context (n_ctx=256)
    """
    if isinstance(prompt, str):
        tokens = model.to_tokens(prompt, prepend_bos=False)[0]
    else:
        tokens = torch.as_tensor(prompt, dtype=torch.long).squeeze()
        if tokens.dim() != 1:
            raise InputError(f"a prompt of token ids must be one sequence, got shape {tuple(tokens.shape)}")
    tokenizer = getattr(model, "tokenizer", None)
    bos = getattr(tokenizer, "bos_token_id", None)
    specials = set(getattr(tokenizer, "all_special_ids", None) or ([bos] if bos is not None else []))
    if bos is not None and (len(tokens) == 0 or int(tokens[0]) not in specials):
        tokens = torch.cat([torch.tensor([bos]), tokens.cpu()])
    if len(tokens) < 2:
        raise InputError("the prompt needs at least one token after the first (whose features are not attributed)")
    if len(tokens) > model.cfg.n_ctx:
        raise InputError(f"the prompt has {len(tokens)} tokens, more than the model's context (n_ctx={model.cfg.n_ctx})")
    if int(tokens.min()) < 0 or int(tokens.max()) >= model.cfg.d_vocab:
        raise InputError(f"token ids must be in [0, {model.cfg.d_vocab}), got {tokens.tolist()}")
    return tokens.to(model.W_E.device)
