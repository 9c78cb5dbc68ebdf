"""Attention explained, what circuit-tracer leaves out: which heads carry an edge, and why a head attended.

In the frozen model of an attribution graph (``ReplacementModel``: patterns and norm divisors at their values on the
prompt, MLP outputs fixed but for the transcoders' skip terms) a source reaches a target along the residual stream, the skip terms and
attention heads. Writing each layer as ``M_l (I + sum_h A_lh)`` (``A_lh`` head h, ``M_l`` the rest), the map from the
source to the target expands exactly as ``M_n...M_1 + sum_l sum_h (M_n...M_l) A_lh P_(l-1)``, where ``P_(l-1)`` is
the whole frozen model up to layer l. So ``edge_heads`` splits an edge into a ``residual`` part (no head on the path;
zero unless source and target share a position) and one part per head, each path credited to the LAST head it
passes: the head's output change ``Delta z_lh`` when the source is added (a frozen forward pass, exact since the
frozen model is affine) times the target's gradient at ``hook_z`` with every head's ``hook_z`` cut from its values
(so the gradient flows along residual and skip paths only; ``experiments.gradients`` captures it). The parts sum to
the edge.

``attention_qk`` explains the pre-softmax score of one head, query position and key position: the residual stream at
each position is a sum of parts (the token embedding, each earlier layer's attention output, each earlier layer's
active features, error and the transcoders' bias and skip terms); with the norm divisors frozen, the query and the key
are affine in those parts, so the score is a sum over (query part, key part) pairs of ``q_i . k_j / attn_scale``, plus
the query and key biases as parts of their own. Each part's query and key are read at ``hook_rot_q``/``hook_rot_k``
(or ``hook_q``/``hook_k``, or the QK norm's output: the last one the model fires) of a run of layer ``l`` alone on
the parts, the divisors held at the prompt's values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from experiments.attribution.graph import AttributionGraph
from experiments.attribution.replacement import ReplacementModel, Sources
from experiments.attribution.targets import logit_directions
from experiments.gradients import capturing_gradients
from workbench.errors import InputError
from workbench.transcoders import TranscoderSet

FINAL = "ln_final.hook_normalized"


@dataclass
class EdgeHeads:
    """An edge split by the last attention head on each path: ``edge == residual + heads.sum()``."""

    edge: float                             # the edge, from a frozen forward pass with the source added
    residual: float                         # paths through no head
    heads: Float[Tensor, "n_layers n_heads"]

    def table(self) -> pd.DataFrame:
        """One row per head with a non-zero part, largest first: ``layer``, ``head``, ``contribution``, ``share``."""
        rows = [{"layer": l, "head": h, "contribution": float(self.heads[l, h])}
                for l, h in self.heads.nonzero().tolist()]
        table = pd.DataFrame(rows, columns=["layer", "head", "contribution"])
        table["share"] = table["contribution"] / self.edge if self.edge else 0.0
        return table.reindex(table["contribution"].abs().sort_values(ascending=False).index).reset_index(drop=True)


@dataclass
class QKAttribution:
    """A head's pre-softmax score split over (query part, key part) pairs: ``matrix.sum() + unexplained == score``
    (``unexplained`` is zero up to rounding unless the model has a non-linear step in the score, e.g. clipping)."""

    score: float
    matrix: Float[Tensor, "n_query_parts n_key_parts"]
    query_labels: list[str]
    key_labels: list[str]
    unexplained: float

    @property
    def query_parts(self) -> pd.Series:
        """Each query-side part's share of the score (summed over the key side)."""
        return pd.Series(self.matrix.sum(1).tolist(), index=self.query_labels, name="query")

    @property
    def key_parts(self) -> pd.Series:
        """Each key-side part's share of the score (summed over the query side)."""
        return pd.Series(self.matrix.sum(0).tolist(), index=self.key_labels, name="key")


class _Frozen:
    """The prompt's frozen model (a ``ReplacementModel`` and its ``record`` of the prompt) and the graph's nodes."""

    def __init__(self, model: Any, transcoders: TranscoderSet, graph: AttributionGraph):
        self.replacement = ReplacementModel(model, transcoders)
        self.model, self.tc, self.graph = model, self.replacement.transcoders, graph
        self.tokens = graph.input_tokens.to(model.W_E.device)
        self.sources: Sources = self.replacement.read_sources(self.tokens)
        if not torch.equal(self.sources.active_features.cpu(), graph.active_features):
            raise InputError("the graph's active features are not these transcoders' on its prompt: pass the model and "
                             "transcoders the graph was attributed with")
        self.final = FINAL if FINAL in model.hook_dict else f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
        z_names = [n for n in model.hook_dict if n.endswith("attn.hook_z")]
        self.clean = self.replacement.record(self.tokens, z_names + [self.final])

    def hooks(self, add: dict[str, Tensor]) -> list:
        """Patterns and divisors at their clean values, each MLP output at its clean value plus the change of its
        skip term, and ``add[name]`` ([pos, d_model]) added at that hook."""
        tc, clean, replacement = self.tc, self.clean, self.replacement

        def mlp_out(layer: int):
            def hook(acts: Tensor, hook: Any) -> Tensor:
                out = replacement.mlp_output(layer, self.inputs[layer], clean[hook.name], clean[tc.input_hook(layer)])
                return out + add[hook.name] if hook.name in add else out
            return hook

        def read(layer: int):
            def hook(acts: Tensor, hook: Any) -> None:
                self.inputs[layer] = acts
            return hook

        self.inputs: dict[int, Tensor] = {}
        hooks = replacement.freeze_hooks(clean)
        hooks += [(tc.input_hook(l), read(l)) for l in range(tc.n_layers)]
        hooks += [(tc.output_hook(l), mlp_out(l)) for l in range(tc.n_layers)]
        if "hook_embed" in add:
            hooks.append(("hook_embed", lambda acts, hook: acts + add["hook_embed"]))
        return hooks

    def node(self, index: int) -> str:
        g = self.graph
        n_features, n_pos = len(g.selected_features), g.n_pos
        kind = ("feature" if index < n_features else "error" if index < n_features + g.n_layers * n_pos
                else "token" if index < n_features + (g.n_layers + 1) * n_pos else "logit")
        return kind

    def writes(self, index: int) -> dict[str, Tensor]:
        """What source node ``index`` adds, by hook name ([pos, d_model] each)."""
        g, src, n_pos = self.graph, self.sources, self.graph.n_pos
        n_features = len(g.selected_features)
        kind = self.node(index)
        out: dict[str, Tensor] = {}

        def put(name: str, pos: int, vec: Tensor) -> None:
            out.setdefault(name, torch.zeros(n_pos, vec.shape[-1], dtype=vec.dtype, device=vec.device))[pos] += vec

        if kind == "feature":
            rows = (src.decoder_source == int(g.selected_features[index])).nonzero().flatten()
            for row in rows.tolist():
                put(self.tc.output_hook(int(src.decoder_layer[row])), int(src.decoder_pos[row]), src.decoder_vecs[row])
        elif kind == "error":
            layer, pos = divmod(index - n_features, n_pos)
            put(self.tc.output_hook(layer), pos, src.error_vecs[layer, pos])
        elif kind == "token":
            pos = index - n_features - g.n_layers * n_pos
            put("hook_embed", pos, src.token_vecs[pos])
        else:
            raise InputError(f"node {index} is a logit node, which is no source")
        return {name: vec.to(self.model.W_E.dtype) for name, vec in out.items()}

    def reads(self, index: int) -> tuple[str, int, Tensor]:
        """Where target node ``index`` reads: (hook, position, direction)."""
        g, n_features = self.graph, len(self.graph.selected_features)
        kind = self.node(index)
        if kind == "feature":
            active = int(g.selected_features[index])
            layer, pos, _ = g.active_features[active].tolist()
            return self.tc.input_hook(layer), pos, self.sources.encoder_vecs[active]
        if kind == "logit":
            rank = index - (g.n_nodes - len(g.logit_token_ids))
            direction = logit_directions(self.model.W_U, g.logit_token_ids[rank:rank + 1].to(self.model.W_E.device))[0]
            return self.final, g.n_pos - 1, direction
        raise InputError(f"node {index} is a {kind} node, which is no target (targets are features and logits)")


def edge_heads(model: Any, transcoders: TranscoderSet, graph: AttributionGraph, target: int, source: int) -> EdgeHeads:
    """The edge ``graph.adjacency_matrix[target, source]`` split over the attention heads that carry it (node
    indices in the adjacency's order; see the module docstring).

    Example (a source at position 1 reaches the logit at position 2 only through the head):
        >>> from experiments.attribution import attribute
        >>> from experiments.attribution.replacement import mlp_transcoders
        >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, act_fn="relu"))
        >>> tc = mlp_transcoders(tiny)
        >>> graph = attribute(tiny, tc, [1, 2, 3], max_n_logits=1, progress=False)
        >>> token_1, logit = graph.n_nodes - 1 - 2, graph.n_nodes - 1
        >>> split = edge_heads(tiny, tc, graph, logit, token_1)
        >>> split.residual, abs(split.heads.sum() - graph.adjacency_matrix[logit, token_1]) < 1e-5
        (0.0, tensor(True))
    """
    _check_indices("a node index", target=(target, graph.n_nodes), source=(source, graph.n_nodes))
    frozen = _Frozen(model, transcoders, graph)
    read_name, read_pos, direction = frozen.reads(target)
    add = frozen.writes(source)
    z_names = sorted((n for n in model.hook_dict if n.endswith("attn.hook_z")), key=lambda n: int(n.split(".")[1]))
    with torch.no_grad():   # 1. the source added to the frozen model: every head's change of z, and the edge
        changed: dict[str, Tensor] = {}
        hooks = frozen.hooks(add) + [(n, lambda acts, hook: changed.__setitem__(hook.name, acts)) for n in z_names]
        hooks.append((read_name, lambda acts, hook: changed.__setitem__("read", acts)))
        model.run_with_hooks(frozen.tokens[None], fwd_hooks=hooks)
        edge = float((changed["read"][0, read_pos] - frozen.clean[read_name][0, read_pos]).to(direction.dtype) @ direction)
    # 2. the target's gradient along residual and skip paths: every hook_z cut from its values, at each write point
    reads: dict[str, Tensor] = {}
    keep_read = (read_name, lambda acts, hook: reads.__setitem__("read", acts))
    with capturing_gradients(model, z_names + list(add), fwd_hooks=frozen.hooks({}) + [keep_read],
                             cut=z_names) as capture:
        model(frozen.tokens[None])
        grads = capture.gradients(reads["read"][0, read_pos].to(direction.dtype) @ direction)
    heads = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.float64)
    for name in z_names:
        delta = (changed[name] - frozen.clean[name])[0].double()              # [pos, head, d_head]
        heads[int(name.split(".")[1])] = torch.einsum("phk,phk->h", grads[name][0].double(), delta)
    residual = sum(float((grads[n][0].double() * add[n].double()).sum()) for n in add)
    return EdgeHeads(edge=edge, residual=residual, heads=heads.float())


def _check_indices(what: str, **bounded: tuple[Any, int]) -> None:
    """Each ``name=(value, bound)`` an int in [0, bound), else an InputError calling it ``what``."""
    for name, (value, bound) in bounded.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < bound:
            raise InputError(f"{name} must be {what} in [0, {bound}), got {value!r}")


def attention_qk(model: Any, transcoders: TranscoderSet, graph: AttributionGraph, layer: int, head: int,
                 query_pos: int, key_pos: int) -> QKAttribution:
    """Why head ``head`` of layer ``layer`` attended from ``query_pos`` to ``key_pos`` on the graph's prompt: its
    pre-softmax score (``hook_attn_scores``) split over pairs of residual parts at the two positions (see the module
    docstring; parts are labelled ``embedding``, ``attn L1``, ``L0 F7`` (a feature), ``error L0``, ``bias+skip L0``
    (the transcoders' ``b_dec`` and skip term, the whole MLP output at position 0) and ``bias``).

    Example:
        >>> from experiments.attribution import attribute
        >>> from experiments.attribution.replacement import mlp_transcoders
        >>> tiny = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, act_fn="relu"))
        >>> tc = mlp_transcoders(tiny)
        >>> graph = attribute(tiny, tc, [1, 2, 3], max_n_logits=1, progress=False)
        >>> qk = attention_qk(tiny, tc, graph, layer=0, head=1, query_pos=2, key_pos=0)
        >>> qk.query_labels, qk.key_labels, abs(qk.unexplained) < 1e-5
        (['embedding', 'bias'], ['embedding', 'bias'], True)
    """
    cfg = model.cfg
    _check_indices("an integer", layer=(layer, cfg.n_layers), head=(head, cfg.n_heads),
                   query_pos=(query_pos, graph.n_pos), key_pos=(key_pos, graph.n_pos))
    frozen = _Frozen(model, transcoders, graph)
    names = {f"blocks.{layer}.attn.hook_attn_scores", "blocks.0.hook_resid_pre", f"blocks.{layer}.hook_resid_pre"} | \
        {f"blocks.{l}.hook_attn_out" for l in range(layer)}
    with torch.no_grad():
        _, cache = model.run_with_cache(frozen.tokens[None], names_filter=lambda n: n in names)
    score = float(cache[f"blocks.{layer}.attn.hook_attn_scores"][0, head, query_pos, key_pos])
    if score == float("-inf"):
        raise InputError(f"head {head} of layer {layer} cannot attend from position {query_pos} to {key_pos} (masked)")
    query_labels, query_vecs = _residual_parts(frozen, cache, layer, query_pos)
    key_labels, key_vecs = _residual_parts(frozen, cache, layer, key_pos)
    q_QK, k_KK = _project_parts(frozen, layer, query_pos, query_vecs, key_pos, key_vecs)
    group = head // (cfg.n_heads // k_KK.shape[1])
    matrix = (q_QK[:, head].double() @ k_KK[:, group].double().T) / cfg.attn_scale
    return QKAttribution(score=score, matrix=matrix.float(), query_labels=query_labels + ["bias"],
                         key_labels=key_labels + ["bias"], unexplained=score - float(matrix.sum()))


def _residual_parts(frozen: _Frozen, cache: Any, layer: int, pos: int) -> tuple[list[str], Tensor]:
    """The residual stream entering ``layer`` at ``pos`` as labelled parts ``[n, d_model]`` summing to it."""
    src, tc = frozen.sources, frozen.tc
    labels, vecs = ["embedding"], [cache["blocks.0.hook_resid_pre"][0, pos]]
    feature_rows = (src.decoder_pos == pos) & (src.decoder_layer < layer)
    for active in src.decoder_source[feature_rows].unique().tolist():
        rows = feature_rows & (src.decoder_source == active)
        source_layer, _, feature = src.active_features[active].tolist()
        labels.append(f"L{source_layer} F{feature}")
        vecs.append(src.decoder_vecs[rows].sum(0))
    for l in range(layer):
        written = src.decoder_vecs[(src.decoder_pos == pos) & (src.decoder_layer == l)].sum(0)
        mlp_out = frozen.clean[tc.output_hook(l)][0, pos]
        labels += [f"attn L{l}", f"error L{l}", f"bias+skip L{l}"]
        vecs += [cache[f"blocks.{l}.hook_attn_out"][0, pos], src.error_vecs[l, pos],
                 mlp_out - written.to(mlp_out.dtype) - src.error_vecs[l, pos].to(mlp_out.dtype)]
    parts = torch.stack([v.to(frozen.model.W_E.dtype) for v in vecs])
    resid = cache[f"blocks.{layer}.hook_resid_pre"][0, pos]
    if not torch.allclose(parts.sum(0), resid, atol=1e-4 * (1 + float(resid.abs().max()))):
        raise InputError("this model's residual stream is not the sum of its embedding, attention and MLP outputs "
                         "(a norm after each sublayer?): attention_qk cannot split it")
    return labels, parts


def _project_parts(frozen: _Frozen, layer: int, query_pos: int, query_vecs: Tensor, key_pos: int, key_vecs: Tensor,
                   ) -> tuple[Float[Tensor, "nq+1 n_heads d_head"], Float[Tensor, "nk+1 n_kv d_head"]]:
    """Each part's query (at ``query_pos``) and key (at ``key_pos``) in layer ``layer`` with its divisors frozen, and
    the biases' (what a zero residual gives) last."""
    model, clean = frozen.model, frozen.clean
    n_q, n_k, n_pos = len(query_vecs), len(key_vecs), frozen.graph.n_pos
    resid = torch.zeros(1 + n_q + n_k, n_pos, model.cfg.d_model, dtype=model.W_E.dtype, device=model.W_E.device)
    resid[1:1 + n_q, query_pos] = query_vecs
    resid[1 + n_q:, key_pos] = key_vecs
    seen: dict[str, list[Tensor]] = {"q": [], "k": []}
    prefix = f"blocks.{layer}."
    q_hooks = ("attn.hook_q", "attn.q_norm.hook_normalized", "attn.hook_rot_q")
    k_hooks = ("attn.hook_k", "attn.k_norm.hook_normalized", "attn.hook_rot_k")

    def record(side: str):
        def hook(acts: Tensor, hook: Any) -> None:
            seen[side].append(acts.reshape(*acts.shape[:2], -1, model.cfg.d_head))
        return hook

    hooks = frozen.replacement.freeze_hooks(clean)   # only this layer's fire: the run is layer ``layer`` alone
    hooks += [(prefix + n, record("q")) for n in q_hooks if prefix + n in model.hook_dict]
    hooks += [(prefix + n, record("k")) for n in k_hooks if prefix + n in model.hook_dict]
    with torch.no_grad():
        model.run_with_hooks(resid, start_at_layer=layer, stop_at_layer=layer + 1, fwd_hooks=hooks)
    q, k = seen["q"][-1], seen["k"][-1]     # the last ones the model fired are what the scores read
    q_parts = torch.cat([q[1:1 + n_q, query_pos] - q[0, query_pos], q[:1, query_pos]])
    k_parts = torch.cat([k[1 + n_q:, key_pos] - k[0, key_pos], k[:1, key_pos]])
    return q_parts, k_parts
