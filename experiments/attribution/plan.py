"""``plan_attribution``: the bytes ``attribute`` will hold, before running it, allocating nothing.

``attribute`` keeps, besides the model and the transcoders:

- ``sources``: every source's vectors (``linearised.read_sources``): active features' encoder and decoder rows (the
  decoder rows twice: also laid out by position for the contraction),
  the error vectors ``[layer, pos, d_model]`` and the token embeddings; while reading them, a cache of the
  transcoders' hooks, the logits ``[pos, d_vocab]`` and every layer's dense activations ``[layer, pos,
  d_transcoder]`` (freed before the forward pass);
- ``forward``: what autograd keeps of the frozen forward pass over copies of the prompt; it is
  counted exactly by running that pass on the meta device under ``saved_tensors_hooks``. It grows as
  ``copies x n_heads x pos^2`` per layer (the frozen attention patterns the values' gradients flow
  through), so it is the part that grows fastest with the prompt: the copies are ``batch_size``, or fewer to keep
  it within ``forward_memory`` (``forward_copies``);
- ``transient``: the largest short-lived tensors: one layer's scores, probabilities and mask while the forward pass runs,
  or the gradients of one backward pass (``n_layers + 1`` write points and the injected gradients, each
  ``[copies, pos, d_model]``), whichever is larger;
- ``adjacency``: the graph ``[n_nodes, n_nodes]`` float32 it returns (rows are written into it batch by batch), and
  with ``max_feature_nodes`` below the number of active features an edge buffer ``[visited + logits, active +
  errors + tokens + logits]`` from which it is copied.

The number of active features is not known before the run: it is ``features_per_token`` (the transcoders' mean
L0 per layer and position; default ``d_transcoder``, the bound) times the layers and the positions after the
first. The peak is ``max(sources while reading, sources + forward + transient + adjacency)``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import pandas as pd
import torch
from torch import Tensor

from workbench.config import ModelConfig
from workbench.errors import InputError
from workbench.loading.build import empty_model
from workbench.memory import readable_bytes
from workbench.transcoders import TranscoderSet

from experiments.attribution.linearised import LinearisedForward

# What the frozen forward pass's copies of the prompt may keep by default (``forward_copies``): 256 MiB bounds the
# part of ``attribute``'s memory that grows with the square of the prompt; below it, fewer copies than targets per
# batch cost no time on the CPU (measured: batch 32 at 512 tokens in 8 copies ran faster than in 32).
FORWARD_MEMORY = 256 * 2**20


def plan_attribution(model: Union[Any, ModelConfig], transcoders: TranscoderSet, n_tokens: int, *,
                     features_per_token: Optional[float] = None, max_feature_nodes: Optional[int] = None,
                     max_n_logits: int = 10, batch_size: int = 256, forward_memory: Optional[int] = FORWARD_MEMORY,
                     dtype: Optional[torch.dtype] = None) -> pd.DataFrame:
    """The bytes ``attribute(model, transcoders, prompt of n_tokens tokens, max_n_logits=..., max_feature_nodes=...,
    batch_size=..., forward_memory=...)`` holds besides the model and the transcoders: one row per part
    (``sources``, ``reading``, ``forward``, ``transient``, ``adjacency``) with ``bytes`` and readable ``size``;
    ``.attrs`` holds ``peak_bytes``, ``peak``, ``n_active``, ``n_nodes`` and ``copies`` (the prompt's copies in the
    frozen forward pass, see ``forward_copies``). ``model`` is a loaded model or its ``ModelConfig`` (then ``dtype``
    defaults to float32); nothing is allocated (the forward pass runs on the meta device).

    Example:
        >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=64, act_fn="relu"))
        >>> tc = wb.TranscoderSet(W_enc=[torch.zeros(4, 8)], b_enc=[torch.zeros(4)], threshold=[None],
        ...     W_dec=[torch.zeros(4, 1, 8)], b_dec=torch.zeros(1, 8), feature_input_hook="mlp.hook_in",
        ...     feature_output_hook="mlp.hook_out")
        >>> table = plan_attribution(tiny, tc, 32, features_per_token=2, batch_size=16)
        >>> table.part.tolist(), table.attrs["n_active"], table.attrs["n_nodes"]
        (['sources', 'reading', 'forward', 'transient', 'adjacency'], 62, 136)
        >>> plan_attribution(tiny, tc, 128)
        Traceback (most recent call last):
        workbench.errors.InputError: n_tokens=128 is past the model's context (n_ctx=64)
    """
    cfg, dtype = _config_and_dtype(model, dtype)
    if not isinstance(transcoders, TranscoderSet):
        raise InputError(f"plan_attribution needs a wb.TranscoderSet, got {type(transcoders).__name__}")
    if not isinstance(n_tokens, int) or n_tokens < 2:
        raise InputError(f"n_tokens must be an integer of at least 2, got {n_tokens!r}")
    if n_tokens > cfg.n_ctx:
        raise InputError(f"n_tokens={n_tokens} is past the model's context (n_ctx={cfg.n_ctx})")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    per_token = transcoders.d_transcoder if features_per_token is None else features_per_token
    if not 0 <= per_token <= transcoders.d_transcoder:
        raise InputError(f"features_per_token must be in [0, d_transcoder={transcoders.d_transcoder}], got {per_token!r}")
    size = torch.empty(0, dtype=dtype).element_size()
    L, P, D, F = transcoders.n_layers, n_tokens, cfg.d_model, transcoders.d_transcoder
    n_active = int(round(per_token * L * (P - 1)))
    n_out = sum(transcoders.W_dec[layer].shape[1] for layer in range(L)) // L   # decoder rows per feature
    n_logits = min(max_n_logits, cfg.d_vocab)
    n_selected = n_active if max_feature_nodes is None else min(max_feature_nodes, n_active)
    n_nodes = n_selected + (L + 1) * P + n_logits
    # encoder rows, decoder rows, and the decoder rows again laid out by position for the contraction
    kept = size * (n_active * D * (1 + 2 * n_out) + (L + 1) * P * D) + 4 * P * D
    reading = size * ((2 * L + 1) * P * D + 2 * L * P * D + L * P * F + P * F) + 4 * P * cfg.d_vocab
    copies = forward_copies(cfg, transcoders, P, batch_size, forward_memory, dtype)
    saved, scores = _forward_bytes(cfg, transcoders, P, copies, dtype)
    gradients = size * (L + 3) * copies * P * D
    transient = max(scores, gradients)
    adjacency = _adjacency_bytes(n_active, n_selected, (L + 1) * P, n_logits)
    parts = {"sources": kept, "reading": reading, "forward": saved, "transient": transient, "adjacency": adjacency}
    table = pd.DataFrame({"part": list(parts), "bytes": list(parts.values())})
    table["size"] = table["bytes"].map(readable_bytes)
    peak = max(kept + reading, kept + saved + transient + adjacency)
    table.attrs.update(peak_bytes=peak, peak=readable_bytes(peak), n_active=n_active, n_nodes=n_nodes,
                       batch_size=batch_size, copies=copies, n_tokens=n_tokens, n_logits=n_logits,
                       n_other_nodes=(L + 1) * P)
    return table


def _adjacency_bytes(n_active: int, n_selected: int, n_other_nodes: int, n_logits: int) -> int:
    """The graph [n_nodes, n_nodes] float32, and with fewer nodes than active features the edge buffer it is
    copied from ([selected + logits, active + errors + tokens + logits])."""
    n_nodes = n_selected + n_other_nodes + n_logits
    adjacency = 4 * n_nodes * n_nodes
    if n_selected < n_active:
        adjacency += 4 * (n_selected + n_logits) * (n_active + n_other_nodes + n_logits)
    return adjacency


def feature_nodes_within(plan: pd.DataFrame, budget: int) -> Optional[int]:
    """The most feature nodes (``max_feature_nodes``) for which the graph of ``plan`` (``plan_attribution``'s
    table, its settings otherwise kept) holds at most ``budget`` bytes in its adjacency and forward copies: None
    when every active feature fits (no limit needed), 0 when not even one feature does (a shorter prompt is needed).

    Example:
        >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=64, act_fn="relu"))
        >>> tc = wb.TranscoderSet(W_enc=[torch.zeros(4, 8)], b_enc=[torch.zeros(4)], threshold=[None],
        ...     W_dec=[torch.zeros(4, 1, 8)], b_dec=torch.zeros(1, 8), feature_input_hook="mlp.hook_in",
        ...     feature_output_hook="mlp.hook_out")
        >>> plan = plan_attribution(tiny, tc, 32, features_per_token=2, batch_size=16)
        >>> budget = int(plan.set_index("part").loc[["adjacency", "forward"], "bytes"].sum())
        >>> feature_nodes_within(plan, budget), feature_nodes_within(plan, budget - 1), feature_nodes_within(plan, 0)
        (None, 36, 0)
    """
    parts = plan.set_index("part")["bytes"]
    n_active, other, logits = plan.attrs["n_active"], plan.attrs["n_other_nodes"], plan.attrs["n_logits"]
    room = budget - int(parts["forward"])

    def fits(n_selected: int) -> bool:
        return _adjacency_bytes(n_active, n_selected, other, logits) <= room

    if fits(n_active):
        return None
    low, high = 0, n_active   # fits(low) or low == 0; not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low if fits(low) else 0


def forward_copies(model: Union[Any, ModelConfig], transcoders: TranscoderSet, n_tokens: int, batch_size: int,
                   forward_memory: Optional[int] = FORWARD_MEMORY, dtype: Optional[torch.dtype] = None) -> int:
    """How many copies of the prompt ``attribute``'s frozen forward pass runs: ``batch_size``, or fewer so that
    what autograd keeps of them (the per-copy attention patterns grow as ``n_heads x pos^2`` per layer) fits in
    ``forward_memory`` bytes; at least one. ``None``: ``batch_size`` copies whatever they take.

    Each batch of ``batch_size`` targets then takes ``ceil(batch_size / copies)`` backward passes: the rows, and
    the features a limited graph visits, are the same whatever the copies.

    Example:
        >>> cfg = wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=50, n_ctx=2048, act_fn="relu")
        >>> tc = wb.TranscoderSet(W_enc=[torch.zeros(4, 16)] * 2, b_enc=[torch.zeros(4)] * 2, threshold=[None] * 2,
        ...     W_dec=[torch.zeros(4, 1, 16)] * 2, b_dec=torch.zeros(2, 16), feature_input_hook="mlp.hook_in",
        ...     feature_output_hook="mlp.hook_out")
        >>> forward_copies(cfg, tc, 64, 256), forward_copies(cfg, tc, 1024, 256), forward_copies(cfg, tc, 1024, 256, None)
        (256, 7, 256)
    """
    if forward_memory is None:
        return batch_size
    if not isinstance(forward_memory, int) or isinstance(forward_memory, bool) or forward_memory < 1:
        raise InputError(f"forward_memory must be a positive number of bytes or None, got {forward_memory!r}")
    cfg, dtype = _config_and_dtype(model, dtype)
    per_copy, _ = _forward_bytes(cfg, transcoders, n_tokens, 1, dtype)
    return max(1, min(batch_size, forward_memory // max(per_copy, 1)))


def _config_and_dtype(model: Union[Any, ModelConfig], dtype: Optional[torch.dtype]) -> tuple[ModelConfig, torch.dtype]:
    """A loaded model's config and weight dtype, or a bare config's with ``dtype`` defaulting to float32."""
    if isinstance(model, ModelConfig):
        return model, dtype or torch.float32
    return model.config, dtype or model.W_E.dtype


def _forward_bytes(cfg: ModelConfig, transcoders: TranscoderSet, n_tokens: int, batch: int,
                   dtype: torch.dtype) -> tuple[int, int]:
    """(bytes autograd saves in ``LinearisedForward`` on ``batch`` copies, bytes of the largest layer's scores and
    float32 probabilities), from a run on the meta device; parameters are not counted (they are the model's)."""
    meta = empty_model(cfg)
    meta.to(device="meta", dtype=dtype)   # also the rotary tables, which are built on the CPU
    tc = transcoders.to(device="meta", dtype=dtype)
    params = {id(p) for p in meta.parameters()}
    seen: dict[int, Tensor] = {}   # kept alive, so no id is reused by a later tensor (meta tensors cost nothing)
    saved = [0]
    pattern = [0]

    def pack(t: Tensor) -> Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in params and id(t) not in seen:
            seen[id(t)] = t
            saved[0] += t.numel() * t.element_size()
        return t

    def watch(acts: Tensor, hook: Any) -> None:   # the scores, their float32 softmax and the mask's bias
        pattern[0] = max(pattern[0], acts.numel() * (2 * acts.element_size() + 4))

    tokens = torch.zeros(n_tokens, dtype=torch.long, device="meta")
    scores = [(name, watch) for name in meta.hook_dict if name.endswith("attn.hook_attn_scores")]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), meta.hooks(fwd_hooks=scores):
        forward = LinearisedForward(meta, tc, tokens, sources=None, batch=batch)
    del forward
    return saved[0], pattern[0]
