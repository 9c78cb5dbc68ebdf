"""Information flow routes (Ferrando & Voita 2024, the graph of facebookresearch/llm-transparency-tool):
which attention edges and blocks carry a token's prediction, from one forward pass.

Legend: P position, S key position, H n_heads, G n_key_value_heads, K d_head, D d_model, V d_vocab,
L n_layers.

Every residual update is a sum of parts. Attention at layer l and target position i:
resid_mid[i] = resid_pre[i] + sum_{j <= i, h} c_ijh + b_O, where c_ijh = A[h, i, j] * v[j, h] @ W_O[h]
(``hook_pattern``, ``hook_v`` with each key/value head repeated for the query heads of its group, as
the model reads it; latent attention's ``hook_v`` is per head already; value biases are inside
``hook_v``). The MLP: resid_post[i] = resid_mid[i] + mlp_out[i] (a mixture of experts' output is its
``hook_mlp_out``). Parallel blocks (``parallel_attn_mlp``) make one sum: resid_post = resid_pre +
sum c_ijh + b_O + mlp_out.

A part's importance in its sum (the method's proximity rule): max(||whole||_1 - ||whole - part||_1, eps),
divided by the total over the parts of that sum, so the importances of one sum add up to 1. As in
the tool, attention parts are per (source, head); an attention edge j -> i weighs the sum over
heads and keeps the per-head values to say which heads carry it. The bias b_O, where the model
has one (with an output norm: its constant part), is a part of its own (the tool leaves it out of the parts).

The graph, from the final residual state at the chosen token down: nodes are residual states
(``embed``, after attention ``mid``, after the block ``post``) at (layer, position) and MLP block
nodes (``mlp``); edges are attention edges, residual edges and the MLP's in/out edges, kept when
their importance is at least the threshold and their target is reachable from the start. The
tool merges the self-attention edge j = i into the residual edge; here they stay two edges.

Sandwich blocks (x + ln_post(f(ln(x))), Gemma 2/3) and sublayer_output blocks (x + ln_post(f(x)),
OLMo 2) keep each residual update a plain sum, of the sublayer's normed output: ``hook_mlp_out`` is
the MLP's (already normed), and attention's splits through ln1_post's linear part with its scale s_i
frozen at its value at target i (``Decoder.apply_output_norm``): c_ijh = A[h, i, j] / s_i *
ln1_post.linear(v[j, h] @ W_O[h]), and the bias part is b_O through it too (plus a LayerNorm
ln1_post's own bias), so the parts sum exactly to ``hook_attn_out``. Post-norm models (ln(x + f(x)))
are refused with an ``InputError``: there the norm after the residual sum mixes its parts.

``python -m experiments.flow --model NAME --out DIR [--prompt TEXT --position P --threshold T]``
The command line is ``experiments.cli.flow``, the figures ``experiments.plots.flow``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from experiments._flow_parts import (_attention_parts, _one_prompt, _require_flow_model,
                                     attention_by_source, run_flow_cache)  # noqa: F401  (re-exported)
from experiments._progress import Progress, ProgressArg
from experiments._tokens import str_tokens
from experiments.flow_tables import FlowTables
from workbench.tokens_api import TextOrTokens
from experiments.lens import promoted_and_suppressed
from workbench.errors import InputError

EPS = 1e-5  # the tool's floor for a part's proximity (a part never counts as less than nothing)
DEFAULT_THRESHOLD = 0.04  # the tool's default contribution threshold
CHUNK_ELEMENTS = 2**20  # floats of [targets, sources, heads, d_model] decomposed at a time (4 MB: cache-sized)
BLOCKS = ("attn", "mlp")


@dataclass(frozen=True, eq=False)
class FlowContributions:
    """Importance of every part of every residual update of one prompt (each sum's parts add up to 1).

    ``attn_LPSH[l, i, j, h]``: source j through head h in the attention sum at (l, i) (0 for j > i);
    ``attn_resid_LP``, ``attn_bias_LP``: the residual and b_O in that sum (bias 0 without one);
    ``mlp_LP``: the MLP in its sum (the MLP sum, or the one sum of a parallel block), None without MLPs;
    ``mlp_resid_LP``: the residual in the MLP sum (None for parallel blocks and attention-only models);
    ``patterns_LHPS``: every head's attention pattern in the forward pass the importances come from (what
    ``experiments.attention.attention_patterns`` returns for the prompt: the Information flow page draws the
    heads of an edge from it, without a second forward; None in a table built by hand).

    The tables live in ``tables`` (``experiments.flow_tables.FlowTables``): an attention sum's row is split into
    its parts when first read, so a graph from one token splits only the sums it reaches (``flow_graph``,
    ``edge_heads``); reading ``attn_LPSH`` (or the other attention-sum tables) fills every row.

    Example:
        >>> c = flow_contributions(model, model.to_tokens("The cat sat"))   # 6 tokens, toy-attn-2l: attention only
        >>> sums_LP = c.attn_LPSH.sum((2, 3)) + c.attn_resid_LP + c.attn_bias_LP   # (+ mlp_LP if parallel)
        >>> torch.allclose(sums_LP, torch.ones(2, 6)), c.mlp_LP is None
        (True, True)
    """

    tables: FlowTables
    parallel: bool
    str_tokens: list[str]
    patterns_LHPS: Optional[Float[Tensor, "n_layers n_heads pos key_pos"]] = None

    @property
    def attn_LPSH(self) -> Float[Tensor, "n_layers pos key_pos n_heads"]:
        return self.tables.complete().attn_LPSH

    @property
    def attn_resid_LP(self) -> Float[Tensor, "n_layers pos"]:
        return self.tables.complete().attn_resid_LP

    @property
    def attn_bias_LP(self) -> Float[Tensor, "n_layers pos"]:
        return self.tables.complete().attn_bias_LP

    @property
    def mlp_LP(self) -> Optional[Float[Tensor, "n_layers pos"]]:
        return (self.tables.complete() if self.parallel else self.tables).mlp_LP

    @property
    def mlp_resid_LP(self) -> Optional[Float[Tensor, "n_layers pos"]]:
        return self.tables.mlp_resid_LP

    @property
    def n_layers(self) -> int:
        return self.tables.attn_LPSH.shape[0]

    @property
    def n_positions(self) -> int:
        return self.tables.attn_LPSH.shape[1]


def _proximity(parts: Tensor, whole: Tensor) -> Tensor:
    """Un-normalised proximity of each part to the whole: max(||whole||_1 - ||whole - part||_1, EPS)."""
    return (whole.abs().sum(-1) - (whole - parts).abs().sum(-1)).clamp(min=EPS)


def importance(parts: Float[Tensor, "parts *cases d_model"], whole: Float[Tensor, "*cases d_model"]
               ) -> Float[Tensor, "parts *cases"]:
    """Each part's importance in ``whole`` (the method's L1 proximity rule, normalised over the parts).

    Example:
        >>> importance(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([1.0, 1.0]))
        tensor([0.5000, 0.5000])
    """
    if parts.shape[1:] != whole.shape:
        raise InputError(f"parts {tuple(parts.shape)} must be [n_parts, *whole.shape] with whole {tuple(whole.shape)}")
    proximity = _proximity(parts.float(), whole.float())
    return proximity / proximity.sum(0, keepdim=True)


def _attention_proximity(pattern_tSH: Tensor, vo_SHD: Tensor, whole_tD: Tensor, targets: list[int],
                         offset: int) -> Tensor:
    """Raw proximity of every c_ijh to whole[i] for the target positions ``targets`` (ascending; row t of the
    pattern and of ``whole`` is target ``targets[t]``), a chunk of targets at a time, 0 for a source j past its
    target (key position j > i + ``offset``, the keys before the prompt): [t, S, H]."""
    (T, S, H), device = pattern_tSH.shape, pattern_tSH.device
    out_tSH = torch.zeros(T, S, H, device=device)
    per_target = max(1, CHUNK_ELEMENTS // (S * H * vo_SHD.shape[-1]))
    positions_t = torch.tensor(targets, device=device)
    for start in range(0, T, per_target):
        stop = min(T, start + per_target)
        keys = targets[stop - 1] + 1 + offset  # causal: these targets see no key past the last one's position
        whole_pD = whole_tD[start:stop]
        # |c - whole| in place: the chunk is the only big tensor, and three passes over it are the cost
        dist_pSHD = torch.mul(pattern_tSH[start:stop, :keys, :, None], vo_SHD[None, :keys])
        dist_pSHD.sub_(whole_pD[:, None, None]).abs_()
        prox = (whole_pD.abs().sum(-1)[:, None, None] - dist_pSHD.sum(-1)).clamp(min=EPS)  # _proximity, chunked
        causal_pS = torch.arange(keys, device=device)[None, :] <= positions_t[start:stop, None] + offset
        out_tSH[start:stop, :keys] = prox * causal_pS[..., None]
    return out_tSH


def _whole_after_attention(model, cache, layer: int) -> Tensor:
    """The residual state attention's sum writes at ``layer``: resid_mid, or resid_post when it is the block's only
    sum (attention only, parallel blocks) [P, D]."""
    cfg = model.cfg
    name = "hook_resid_post" if (cfg.parallel_attn_mlp or cfg.attn_only) else "hook_resid_mid"
    return cache[f"blocks.{layer}.{name}"][0].float()


def _attention_rows(model, cache, layer: int, targets: list[int]
                    ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """The importances in the attention sums of ``layer`` at the ``targets`` positions (ascending): (sources by head
    [t, S, H], residual [t], bias [t], a parallel block's MLP [t] or None), each row's parts adding up to 1."""
    at = lambda name: cache[f"blocks.{layer}.{name}"][0].float()  # noqa: E731
    rows = torch.tensor(targets)
    whole_tD = _whole_after_attention(model, cache, layer)[rows]
    weights_PSH, values_SHD, constant_PD = _attention_parts(model, cache, layer)
    attn_tSH = _attention_proximity(weights_PSH[rows], values_SHD, whole_tD, targets,
                                    offset=weights_PSH.shape[1] - weights_PSH.shape[0])
    resid_t = _proximity(at("hook_resid_pre")[rows], whole_tD)
    bias_t = _proximity(constant_PD[rows], whole_tD) if constant_PD is not None else torch.zeros_like(resid_t)
    parallel = model.cfg.parallel_attn_mlp
    mlp_t = _proximity(at("hook_mlp_out")[rows], whole_tD) if parallel else torch.zeros_like(resid_t)
    total_t = attn_tSH.sum((1, 2)) + resid_t + bias_t + mlp_t
    return (attn_tSH / total_t[:, None, None], resid_t / total_t, bias_t / total_t,
            mlp_t / total_t if parallel else None)


def _mlp_importance(model, cache, layer: int) -> tuple[Tensor, Tensor]:
    """A sequential block's MLP sum at every position: (the MLP's importance [P], the residual's [P])."""
    at = lambda name: cache[f"blocks.{layer}.{name}"][0].float()  # noqa: E731
    mlp_P, resid_P = importance(torch.stack([at("hook_mlp_out"), at("hook_resid_mid")]), at("hook_resid_post"))
    return mlp_P, resid_P


@torch.no_grad()
def flow_contributions(model, tokens: TextOrTokens, *, progress: ProgressArg = False) -> FlowContributions:
    """The importance of every attention edge (per head), residual, bias and MLP of one prompt, layer by layer.

    One forward pass with a names filter (``run_flow_cache``), whose attention patterns come with the result
    (``patterns_LHPS``); each sequential MLP sum is scored at once, and each attention sum's row is decomposed by
    source and head (``attention_by_source``, in chunks of targets) and scored by ``importance`` when first read
    (``FlowContributions.tables``). ``progress``: True (a bar), False or a ``(done, total)`` callable, per layer.

    Example:
        >>> c = flow_contributions(model, model.to_tokens("The cat sat on the"))   # 8 tokens
        >>> c.attn_LPSH.shape   # [n_layers, pos, key_pos, n_heads]
        torch.Size([2, 8, 8, 4])
    """
    cfg = model.cfg
    tokens_BP = _one_prompt(model, tokens)
    cache = run_flow_cache(model, tokens_BP)
    sequential_mlp = not cfg.attn_only and not cfg.parallel_attn_mlp
    mlp, mlp_resid = [], []
    with Progress(progress, total=cfg.n_layers, desc="information flow") as bar:
        for l in range(cfg.n_layers):
            if sequential_mlp:
                for table, values in zip((mlp, mlp_resid), _mlp_importance(model, cache, l)):
                    table.append(values)
            bar.advance()
    patterns_LHPS = torch.stack([cache[f"blocks.{l}.attn.hook_pattern"][0].float() for l in range(cfg.n_layers)])
    P = tokens_BP.shape[1]
    # What the rows read later, kept with the tables; the patterns once, as views of those the page draws.
    kept = {name: cache[name] for name in cache if not name.endswith("hook_pattern")}
    kept.update({f"blocks.{l}.attn.hook_pattern": patterns_LHPS[l][None] for l in range(cfg.n_layers)})

    def fill(layer: int, targets: list[int]):
        with torch.no_grad():  # a row read later, outside this call
            return _attention_rows(model, kept, layer, targets)

    stack = lambda rows: torch.stack(rows).cpu() if rows else None  # noqa: E731
    tables = FlowTables((cfg.n_layers, P, patterns_LHPS.shape[-1], cfg.n_heads), cfg.parallel_attn_mlp, fill,
                        stack(mlp), stack(mlp_resid))
    return FlowContributions(tables, cfg.parallel_attn_mlp, str_tokens(model, tokens_BP[0]), patterns_LHPS.cpu())


# ---- the graph ----------------------------------------------------------------------------------------
def _node(stage: str, layer: int, position: int) -> str:
    return f"embed:{position}" if stage == "embed" else f"L{layer}.{stage}:{position}"


def _input_node(layer: int, position: int) -> str:
    """The residual state entering ``layer``: the embedding or the previous block's output."""
    return _node("embed", -1, position) if layer == 0 else _node("post", layer - 1, position)


def _check_graph_args(contributions: FlowContributions, position: int, threshold: float) -> int:
    P = contributions.n_positions
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or not -P <= position < P:
        raise InputError(f"position must be a whole number in {-P}..{P - 1} (the prompt has {P} tokens), "
                         f"got {position!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.number)) or not 0.0 <= threshold <= 1.0:
        raise InputError(f"threshold must be a number in 0..1 (importances of one sum add up to 1), got {threshold!r}")
    return int(position) % P


def _head_text(importance_H: Tensor) -> str:
    """The heads carrying at least a tenth of an edge, strongest first: "H3 0.21, H0 0.05"."""
    order = importance_H.argsort(descending=True).tolist()
    total = float(importance_H.sum())
    return ", ".join(f"H{h} {float(importance_H[h]):.3f}" for h in order if importance_H[h] >= 0.1 * total)


def flow_graph(contributions: FlowContributions, position: int = -1,
               threshold: float = DEFAULT_THRESHOLD) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The edges with importance >= ``threshold`` reachable from the final residual state at ``position``.

    Returns (nodes, edges). nodes: DataFrame[node, stage, layer, position, token, block] (stage
    "embed", "mid", "post" or "mlp"; block: what the vocabulary view of the node projects, "attn",
    "mlp" or "" for an embedding). edges: DataFrame[edge, kind, layer, source, target,
    source_position, target_position, importance, top_head, heads] (kind "attention", "residual",
    "mlp_in" or "mlp"; top_head -1 where no head applies), strongest first.

    Example:
        >>> nodes, edges = flow_graph(flow_contributions(model, tokens), position=-1, threshold=0.04)
        >>> nodes.node[0], bool(edges.importance.ge(0.04).all()), sorted(edges.kind.unique())
        ('L1.post:13', True, ['attention', 'residual'])
    """
    start = _check_graph_args(contributions, position, threshold)
    c, t, L = contributions, contributions.tables, contributions.n_layers  # t: rows filled as the walk reads them
    reached, rows = {start}, []  # positions reached at the residual level being walked down

    def add(kind, layer, source, target, i, j, value, heads_H=None):
        rows.append(dict(kind=kind, layer=layer, source=source, target=target, source_position=j, target_position=i,
                         importance=float(value), top_head=-1 if heads_H is None else int(heads_H.argmax()),
                         heads="" if heads_H is None else _head_text(heads_H)))

    for l in range(L - 1, -1, -1):
        if c.parallel:
            t.ensure(l, reached)  # the MLP's share is in the one sum: its rows first
        if t.mlp_LP is not None:  # the MLP writes the block output, in its own sum or the parallel one
            for i in sorted(reached):
                if t.mlp_LP[l, i] >= threshold:
                    mlp = _node("mlp", l, i)
                    source = _input_node(l, i) if c.parallel else _node("mid", l, i)
                    add("mlp", l, mlp, _node("post", l, i), i, i, t.mlp_LP[l, i])
                    add("mlp_in", l, source, mlp, i, i, t.mlp_LP[l, i])
        attn_stage = "post" if (c.parallel or t.mlp_LP is None) else "mid"
        if attn_stage == "mid":
            reached = {i for i in reached if t.mlp_LP[l, i] >= threshold or t.mlp_resid_LP[l, i] >= threshold}
            for i in sorted(reached):
                if t.mlp_resid_LP[l, i] >= threshold:
                    add("residual", l, _node("mid", l, i), _node("post", l, i), i, i, t.mlp_resid_LP[l, i])
        t.ensure(l, reached)  # only the attention sums the walk reaches are split into their parts
        below = {i for i in reached if t.mlp_LP is not None and c.parallel and t.mlp_LP[l, i] >= threshold}
        for i in sorted(reached):
            target = _node(attn_stage, l, i)
            if t.attn_resid_LP[l, i] >= threshold:
                add("residual", l, _input_node(l, i), target, i, i, t.attn_resid_LP[l, i])
                below.add(i)
            edge_S = t.attn_LPSH[l, i, :i + 1].sum(-1)  # causal: a source at or before its target
            for j in (edge_S >= threshold).nonzero().flatten().tolist():
                add("attention", l, _input_node(l, j), target, i, j, edge_S[j], t.attn_LPSH[l, i, j])
                below.add(j)
        reached = below
    edges = pd.DataFrame(rows, columns=["kind", "layer", "source", "target", "source_position", "target_position",
                                        "importance", "top_head", "heads"])
    edges.insert(0, "edge", edges["kind"] + " " + edges["source"] + " -> " + edges["target"])
    edges = edges.sort_values("importance", ascending=False, kind="stable").reset_index(drop=True)
    return _nodes_table(c, edges, _node("post", L - 1, start)), edges


def _nodes_table(c: FlowContributions, edges: pd.DataFrame, start: str) -> pd.DataFrame:
    """Every node the edges touch (and the start node), with the block its vocabulary view projects."""
    names = list(dict.fromkeys([start, *edges["source"], *edges["target"]]))
    rows = []
    for name in names:
        place, position = name.rsplit(":", 1)
        stage, layer = ("embed", -1) if place == "embed" else (place.split(".")[1], int(place.split(".")[0][1:]))
        # mid states are written by attention, post states by the MLP (attention without a sequential MLP)
        block = "" if stage == "embed" else "attn" if stage == "mid" or (
            stage == "post" and (c.tables.mlp_LP is None or c.parallel)) else "mlp"
        rows.append(dict(node=name, stage=stage, layer=layer, position=int(position),
                         token=c.str_tokens[int(position)], block=block))
    return pd.DataFrame(rows, columns=["node", "stage", "layer", "position", "token", "block"])


def edge_heads(contributions: FlowContributions, layer: int, target_position: int, source_position: int
               ) -> pd.DataFrame:
    """Each head's share of the attention edge source -> target at ``layer``: DataFrame[head, importance], strongest first.

    Example:
        >>> heads = edge_heads(flow_contributions(model, tokens), layer=0, target_position=4, source_position=3)
        >>> heads["head"].tolist()[0], list(heads.columns)   # head 0 (previous-token) carries " c" -> "at"
        (0, ['head', 'importance'])
    """
    L, P = contributions.n_layers, contributions.n_positions
    if not (0 <= layer < L and 0 <= source_position <= target_position < P):
        raise InputError(f"no attention edge {source_position} -> {target_position} at layer {layer}: layers are "
                         f"0..{L - 1}, positions 0..{P - 1}, and a source comes at or before its target")
    values_H = contributions.tables.ensure(layer, [target_position]).attn_LPSH[layer, target_position, source_position]
    table = pd.DataFrame({"head": np.arange(len(values_H)), "importance": values_H.numpy()})
    return table.sort_values("importance", ascending=False, kind="stable").reset_index(drop=True)


# ---- what a block writes, in vocabulary terms ---------------------------------------------------------------
@torch.no_grad()
def vocab_projection(model, tokens: TextOrTokens, layer: int, position: int, block: str = "mlp",
                     k: int = 10) -> pd.DataFrame:
    """The ``k`` tokens that ``block``'s output at (layer, position) promotes most and suppresses most.

    The output goes through the final norm with its scale frozen at the final residual of that
    position (as direct logit attribution reads a component) and the unembedding, without its bias:
    its direct effect on that position's logits. Returns DataFrame[direction, rank, token, token_id,
    effect] ("promoted" rows first, then "suppressed", most negative first; the columns of
    ``experiments.neurons.direct_logit_effect``).

    Example:
        >>> projection = vocab_projection(model, tokens, layer=1, position=-1, block="attn", k=3)
        >>> projection.direction.tolist(), list(projection.columns)
        (['promoted', 'promoted', 'promoted', 'suppressed', 'suppressed', 'suppressed'], ['direction', 'rank', 'token', 'token_id', 'effect'])
        >>> vocab_projection(model, tokens, layer=1, position=-1, block="mlp")   # toy-attn-2l has no MLP
        Traceback (most recent call last):
        workbench.errors.InputError: block must be one of ('attn',) for this model, got 'mlp'
    """
    cfg = model.cfg
    _require_flow_model(model)
    tokens_BP = _one_prompt(model, tokens)
    P = tokens_BP.shape[1]
    if block not in BLOCKS or (block == "mlp" and cfg.attn_only):
        raise InputError(f"block must be one of {BLOCKS if not cfg.attn_only else ('attn',)} for this model, got {block!r}")
    if not (0 <= layer < cfg.n_layers and -P <= position < P):
        raise InputError(f"(layer, position) = ({layer}, {position}) is outside 0..{cfg.n_layers - 1} x {-P}..{P - 1}")
    name = f"blocks.{layer}.hook_{block}_out"
    _, cache = model.run_with_cache(tokens_BP, names_filter=lambda n: n in (name, "ln_final.hook_scale"))
    scale = cache["ln_final.hook_scale"][0, position] if "ln_final.hook_scale" in cache else None
    normed_D = model.apply_final_norm(cache[name][0, position], frozen_scale=scale)
    return promoted_and_suppressed(model, normed_D.float() @ model.W_U.float(), k)




if __name__ == "__main__":  # the command line lives in experiments.cli.flow
    from experiments._cli import run_command

    run_command("flow")
