"""The hook-point table of ``docs/hooks.md``, generated from real models so it cannot go stale.

A handful of small ``Decoder``s together exercise every kind of hook (absolute and rotary
positions, LayerNorm and RMSNorm, pre- and post-norm, dense, gated and mixture-of-experts MLPs with
each router and shared experts, dense layers among expert layers, attention-only blocks, attention
sinks, multi-head latent attention with and without a query bottleneck, differential attention). Each runs
``run_with_cache`` on new tokens after a cached prefix, with every dimension given a size no other
dimension has, so each axis of each cached tensor maps back to exactly one dimension name; ``key_pos`` differs from ``pos`` because the prefix sits in the KV
cache. The filter names every hook, so the opt-in ``attn.hook_result`` is computed and listed too.

Regenerate the page with ``python -m workbench.hook_table > docs/hooks.md``;
``tests/unit/test_docs.py`` fails while the committed page differs from what this prints.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable

import torch

from workbench.config import ModelConfig
from workbench.generation import KVCache
from workbench.model import Decoder
from workbench.sae.model import hook_points_markdown
from workbench.hook_table_models import DIMENSIONS, PREFIX, reference_models

def _has_dense_mlp(cfg: ModelConfig) -> bool:
    """Whether some layer has a dense MLP (DeepSeek's first layers are dense among expert layers)."""
    return not cfg.attn_only and 0 in cfg.layer_values("num_experts")


# How the "models" column names the set of models that have a hook. A hook's set of reference
# models must equal exactly one label's set (checked), so the labels stay true as models change.
WHICH_MODELS: list[tuple[str, Callable[[ModelConfig], bool]]] = [
    ("all", lambda cfg: True),
    ("with a norm before attention (not sublayer_output)", lambda cfg: cfg.norm_placement != "sublayer_output"),
    ("with a norm before the MLP", lambda cfg: not cfg.attn_only and cfg.norm_placement != "sublayer_output"),
    ("with a final norm (not post-norm)", lambda cfg: cfg.has_final_norm),
    ("sandwich or sublayer_output norms", lambda cfg: cfg.norm_placement in ("sandwich", "sublayer_output")),
    ("qk_norm='head'", lambda cfg: cfg.qk_norm == "head"),
    ("qk_norm='projection'", lambda cfg: cfg.qk_norm == "projection"),
    ("embed_norm", lambda cfg: cfg.embed_norm),
    ("sequential blocks with an MLP", lambda cfg: not cfg.attn_only and not cfg.parallel_attn_mlp),
    ("learned or sinusoidal positions", lambda cfg: cfg.positional in ("learned", "sinusoidal")),
    ("rotary", lambda cfg: cfg.positional == "rotary"),
    ("rotary, standard attention", lambda cfg: cfg.positional == "rotary" and not cfg.is_latent_attention),
    ("standard attention (not latent)", lambda cfg: not cfg.is_latent_attention),
    ("latent attention (kv_lora_rank)", lambda cfg: cfg.is_latent_attention),
    ("latent attention with q_lora_rank", lambda cfg: cfg.is_latent_attention and cfg.latent.q_lora_rank is not None),
    ("attn_sinks", lambda cfg: cfg.attn_sinks),
    ("with an MLP (not attn_only)", lambda cfg: not cfg.attn_only),
    ("dense MLP", _has_dense_mlp),  # a model with at least one dense MLP layer
    ("gated dense MLP", lambda cfg: _has_dense_mlp(cfg) and cfg.gated_mlp),
    ("MoE", lambda cfg: cfg.is_moe),
    ("MoE with a shared expert (d_shared_expert)", lambda cfg: cfg.is_moe and cfg.moe.d_shared_expert > 0),
    ("use_split_qkv_input", lambda cfg: cfg.use_split_qkv_input),
    ("differential attention (differential_lambda_init)", lambda cfg: cfg.differential_lambda_init is not None),
]

# What shapes alone do not say. Keys must be names in the table (checked).
NOTES: dict[str, str] = {
    "hook_embed": "token embeddings, W_E[tokens]",
    "hook_pos_embed": "absolute position embeddings, added to hook_embed",
    "ln_embed.hook_normalized": "embed_norm (BLOOM): the normed embeddings, which enter the residual stream",
    "blocks.{l}.ln1.hook_scale": "the norm's divisor: sqrt(var + eps) for LN, sqrt(mean(x^2) + eps) for RMS; "
                                 "with use_split_qkv_input one per head copy ([batch, pos, heads, 1])",
    "blocks.{l}.ln1.hook_normalized": "after the gain w (and LN's bias b); pre-norm: attention's input, "
                                      "post-norm: resid + attention output; with use_split_qkv_input one per "
                                      "head copy ([batch, pos, heads, d_model])",
    "blocks.{l}.hook_q_input": "use_split_qkv_input: each query head's own copy of resid_pre, normed by ln1 "
                               "on its own; patch one head's input here",
    "blocks.{l}.hook_k_input": "as hook_q_input, one copy per key/value head",
    "blocks.{l}.hook_v_input": "as hook_q_input, one copy per key/value head",
    "blocks.{l}.hook_mlp_in": "opt-in: computed only when hooked, cached by name, or with "
                              "set_use_hook_mlp_in(True) (then cache-all too, as in TransformerLens): the MLP's own copy of its input before its norm (resid_mid; the "
                              "block input with parallel_attn_mlp); an edit reaches the MLP only",
    "blocks.{l}.ln2.hook_scale": "as ln1, on the MLP side (never split)",
    "blocks.{l}.ln2.hook_normalized": "as ln1, on the MLP side",
    "ln_final.hook_scale": "as ln1, before the unembedding",
    "ln_final.hook_normalized": "as ln1; the unembedding's input",
    "blocks.{l}.attn.hook_q": "the projection (clamped with clip_qkv), before QK norm and RoPE; latent attention: "
                              "W_QB q_latent (or W_Q x), RoPE then acts on each head's last rotary_dim dims",
    "blocks.{l}.attn.hook_q_latent": "the normed query latent q_a_norm(W_QA x) (q_lora_rank); W_QB maps it to every "
                                     "head's query",
    "blocks.{l}.attn.q_a_norm.hook_scale": "the query latent's RMSNorm divisor (latent_norm_eps)",
    "blocks.{l}.attn.q_a_norm.hook_normalized": "the same tensor as hook_q_latent",
    "blocks.{l}.attn.kv_a_norm.hook_scale": "the key/value latent's RMSNorm divisor (latent_norm_eps)",
    "blocks.{l}.attn.kv_a_norm.hook_normalized": "the same tensor as hook_kv_latent",
    "blocks.{l}.attn.hook_kv_latent": "the normed key/value latent [what the KV cache holds]; editing it changes every "
                                      "head's keys and values",
    "blocks.{l}.attn.hook_k_rope": "the rotary key shared by every head, after RoPE (cached beside the latent): the "
                                   "last rotary_dim dims of every head's key",
    "blocks.{l}.attn.hook_k": "the projection, before QK norm and RoPE; only the new positions under a KV cache",
    "blocks.{l}.attn.q_norm.hook_normalized": "QK norm: per head over d_head (qk_norm='head') or over the "
                                             "whole projection ('projection'); RoPE's input",
    "blocks.{l}.attn.k_norm.hook_normalized": "as q_norm, for the keys",
    "blocks.{l}.ln1_post.hook_normalized": "the norm of attention's output (sandwich, sublayer_output); "
                                           "hook_attn_out sees the same tensor",
    "blocks.{l}.ln2_post.hook_normalized": "the norm of the MLP's output; hook_mlp_out sees the same tensor",
    "blocks.{l}.attn.hook_rot_q": "after RoPE",
    "blocks.{l}.attn.hook_rot_k": "after RoPE (latent attention has none: hook_k_rope, and hook_k holds rotated keys)",
    "blocks.{l}.attn.hook_attn_scores": "q.k / attn_scale (soft-capped with attn_scores_soft_cap) + causal/sliding-window "
                                        "mask (-inf) + ALiBi bias; the sinks are not among them; hooking it runs "
                                        "this layer eager",
    "blocks.{l}.attn.hook_sink_weight": "each query's softmax weight on its head's sink (a learned logit with no "
                                        "value); the pattern's row sums to 1 minus this; hooking it runs this layer "
                                        "eager",
    "blocks.{l}.attn.hook_pattern": "softmax of the scores (with attn_sinks: of the scores and the sink, so the real "
                                    "keys' weights sum to less than one); hooking it runs this layer eager",
    "blocks.{l}.attn.hook_pattern_1": "differential attention: each head pair's first softmax map (query heads "
                                      "0..n_heads/2-1 of hook_pattern); editable apart; hooking it runs this layer eager",
    "blocks.{l}.attn.hook_pattern_2": "each head pair's second map (query heads n_heads/2..), subtracted times lambda: "
                                      "z = RMSNorm((map_1 - lambda map_2) V_pair) (1 - lambda_init); hooking it runs "
                                      "this layer eager",
    "blocks.{l}.attn.hook_result": "opt-in: computed only when hooked; per-head z_h W_O[h], sums (+ b_O) to hook_attn_out",
    "blocks.{l}.hook_resid_mid": "between attention and MLP",
    "blocks.{l}.mlp.hook_pre": "pre-activation; the gate's in a gated MLP",
    "blocks.{l}.mlp.hook_pre_linear": "the gated MLP's linear (W_in) branch",
    "blocks.{l}.mlp.hook_post": "after the activation (times the linear branch if gated): the input to W_out",
    "blocks.{l}.mlp.hook_router_logits": "W_router x (+ b_router), before the scoring (router_scoring), correction "
                                         "bias and group mask; editing it changes which experts run",
    "blocks.{l}.mlp.hook_expert_weights": "weights of the chosen experts (renormalised, times routed_scaling_factor); "
                                          "zeroing one ablates that expert",
    "blocks.{l}.mlp.hook_expert_indices": "integer ids of the chosen experts",
    "blocks.{l}.mlp.shared.hook_pre": "the shared expert (a gated MLP every token runs): its gate's pre-activation",
    "blocks.{l}.mlp.shared.hook_pre_linear": "the shared expert's linear branch",
    "blocks.{l}.mlp.shared.hook_post": "the shared expert's input to its W_out",
    "blocks.{l}.mlp.hook_shared_out": "the shared expert's output (times sigmoid(W_shared_gate x) with "
                                      "shared_expert_gate), added to the routed experts' sum",
}

# Notes for one row of a hook whose shape differs by model kind, keyed by (name, models label);
# they replace the hook's NOTES entry on that row.
ROW_NOTES: dict[tuple[str, str], str] = {
    ("blocks.{l}.attn.hook_k", "latent attention (kv_lora_rank)"):
        "every head's key over every key position, re-expanded from the cached latent on each call: W_KVB c "
        "(no RoPE) followed by hook_k_rope, so already rotated",
    ("blocks.{l}.attn.hook_v", "latent attention (kv_lora_rank)"):
        "every head's value (W_KVB c) over every key position, re-expanded from the cached latent on each call",
    ("blocks.{l}.attn.hook_v", "standard attention (not latent)"):
        "the projection; only the new positions under a KV cache",
    ("blocks.{l}.attn.hook_z", "latent attention (kv_lora_rank)"):
        "the pattern-weighted values, d_head_v wide: W_O is [n_heads, d_head_v, d_model]",
}

_LAYER = re.compile(r"^blocks\.\d+\.")


@dataclass(frozen=True)
class HookRow:
    """One line of the table: a hook name (layers collapsed), its axes, where it exists, a note.

    Example:
        >>> HookRow("blocks.{l}.attn.hook_z", ("batch", "pos", "n_heads", "d_head"), "all").shape[-1]
        'd_head'
    """

    name: str
    shape: tuple[str, ...]
    models: str
    note: str = ""


def layer_pattern(hook_name: str) -> str:
    """The hook name with its layer number replaced by ``{l}``.

    Example:
        >>> layer_pattern("blocks.12.attn.hook_z"), layer_pattern("hook_embed")
        ('blocks.{l}.attn.hook_z', 'hook_embed')
    """
    return _LAYER.sub("blocks.{l}.", hook_name)


def dimension_names(shape: tuple[int, ...], hook_name: str = "?") -> tuple[str, ...]:
    """Names each axis of a tensor from the reference run by its size (see ``DIMENSIONS``).

    Example:
        >>> dimension_names((3, 8, 5, 7))
        ('batch', 'n_heads', 'pos', 'key_pos')
    """
    by_size = {size: name for name, size in DIMENSIONS.items()}
    unknown = [size for size in shape if size not in by_size]
    if unknown:
        raise ValueError(f"{hook_name}: axis size(s) {unknown} of shape {tuple(shape)} match no dimension "
                         "in workbench.hook_table_models.DIMENSIONS; add the new dimension there")
    return tuple(by_size[size] for size in shape)


@torch.no_grad()
def hook_shapes(model: Decoder) -> dict[str, tuple[str, ...]]:
    """Every hook that fires in ``model``, layers collapsed, in firing order, with its axes.

    The run feeds ``pos`` new tokens after a prefix already in a KV cache, so attention's key axis
    (``key_pos``) is longer than its query axis (``pos``).

    Example:
        >>> shapes = hook_shapes(reference_models()["attention-only"])
        >>> shapes["blocks.{l}.attn.hook_pattern"]
        ('batch', 'n_heads', 'pos', 'key_pos')
    """
    batch = DIMENSIONS["batch"]
    generator = torch.Generator().manual_seed(0)
    prefix_BP = torch.randint(0, model.cfg.d_vocab, (batch, PREFIX), generator=generator)
    new_BP = torch.randint(0, model.cfg.d_vocab, (batch, DIMENSIONS["pos"]), generator=generator)
    kv_cache = KVCache(model.cfg.n_layers)
    model(prefix_BP, kv_cache=kv_cache)
    _, cache = model.run_with_cache(new_BP, kv_cache=kv_cache, names_filter=lambda name: True)  # hook_result too

    shapes: dict[str, tuple[str, ...]] = {}
    before, per_layer, after = [], [[] for _ in range(model.cfg.n_layers)], []
    for name, tensor in cache.items():
        pattern, dims = layer_pattern(name), dimension_names(tuple(tensor.shape), name)
        if shapes.setdefault(pattern, dims) != dims:
            raise ValueError(f"{pattern}: shape differs between layers ({shapes[pattern]} vs {dims} at {name})")
        if _LAYER.match(name):
            per_layer[int(name.split(".")[1])].append(pattern)
        else:
            (after if any(per_layer) else before).append(pattern)
    # Layers may differ (a dense first layer among expert layers): merge their orders, so a hook only a
    # later layer has sits where it fires within a block, not after the first block's last hook.
    order = _merge_orders([before + layer_order + after for layer_order in per_layer])
    return {pattern: shapes[pattern] for pattern in order}


def hook_table(models: dict[str, Decoder] | None = None) -> list[HookRow]:
    """One row per hook name over all reference models, in firing order.

    Example:
        >>> rows = {row.name: row for row in hook_table()}
        >>> rows["blocks.{l}.mlp.hook_router_logits"].shape, rows["blocks.{l}.mlp.hook_router_logits"].models
        (('batch', 'pos', 'num_experts'), 'MoE')
    """
    models = reference_models() if models is None else models
    per_model = {label: hook_shapes(model) for label, model in models.items()}
    for label, model in models.items():  # a split-input model: its twin's rows, plus the hooks only it has
        twin = next((other for other, m in models.items()
                     if model.cfg.use_split_qkv_input and not m.cfg.use_split_qkv_input and m.config == model.config), None)
        if twin is not None:  # (in its own firing order; ln1's shapes are the twin's, its split ones in NOTES)
            per_model[label] = {n: per_model[twin].get(n, d) for n, d in per_model[label].items()}
    names = _merge_orders([list(shapes) for shapes in per_model.values()])

    rows = []
    for name in names:  # one row per shape the hook has (a QK norm per head or over the projection; latent
        # attention's keys, values and z): the rarer shapes first, the one most models have last
        having = {label for label, shapes in per_model.items() if name in shapes}
        by_shape = {shape: {label for label in having if per_model[label][name] == shape}
                    for shape in {per_model[label][name] for label in having}}
        for shape in sorted(by_shape, key=lambda shape: (len(by_shape[shape]), shape)):
            which = _which_models(name, by_shape[shape], models)
            rows.append(HookRow(name, shape, which, ROW_NOTES.get((name, which), NOTES.get(name, ""))))

    stale = sorted(set(NOTES) - set(names))
    stale += sorted(f"{key} (ROW_NOTES)" for key in set(ROW_NOTES) - {(row.name, row.models) for row in rows})
    if stale:
        raise ValueError(f"NOTES/ROW_NOTES name hook rows no reference model has: {stale}")
    return rows


def render_markdown(rows: list[HookRow], models: dict[str, Decoder] | None = None) -> str:
    """``docs/hooks.md``: the table, the models it was generated from, and how to read it.

    Example:
        >>> render_markdown(hook_table()).splitlines()[0]
        '# Hook points'
    """
    models = reference_models() if models is None else models
    lines = [
        "# Hook points",
        "",
        "<!-- Generated by `python -m workbench.hook_table > docs/hooks.md`; do not edit by hand.",
        "     tests/unit/test_docs.py fails while this file differs from what the generator prints. -->",
        "",
        "Every hook point a `workbench.Decoder` can expose, with the shape of the tensor the hook receives,",
        "read off real models by `workbench.hook_table` (regenerate: `python -m workbench.hook_table > docs/hooks.md`).",
        "Names are TransformerLens's; `{l}` is the layer. Shape names are the dimensions of",
        "[shapes.md](shapes.md): `pos` is the query position, `key_pos` the key position (the same length",
        "as `pos` in a plain forward, prefix + new tokens under a KV cache), `1` a kept axis of size one.",
        "",
        "A model can hold a `HookPoint` that never fires in its configuration (every `Attention` has",
        "`hook_rot_q`, but only rotary models call it); the *models* column says where each one fires.",
        "A hook whose shape depends on the model has one row per shape. Latent attention's (DeepSeek's",
        "multi-head latent attention, `kv_lora_rank`) `hook_k`/`hook_v` span every key position (`key_pos`):",
        "they are re-expanded from the cached latent on each call, while standard attention's cover only the",
        "new positions (`pos`); its KV cache holds `hook_kv_latent` and `hook_k_rope` instead.",
        "",
        "More names reach existing points (`model.hook_aliases`, TransformerBridge's names): `blocks.{l}.hook_in`",
        "is `blocks.{l}.hook_resid_pre` and `blocks.{l}.hook_out` is `blocks.{l}.hook_resid_post` (what",
        "`transformer_lens.utilities.get_act_name(\"in\", l)` returns), and `blocks.{l}.attn.hook_q_input`",
        "(`k`, `v`) is `blocks.{l}.hook_q_input` (direct path patching looks there). A hook on either",
        "name edits the one tensor; `run_with_cache` caches it under the name asked for, and caching everything",
        "stores each point once, under the name below. With `model.set_ungroup_grouped_query_attention(True)` a",
        "grouped-query model's `hook_k`, `hook_v`, `hook_rot_k`, `hook_k_input` and `hook_v_input` carry",
        "`n_heads` where the table says `n_key_value_heads` (each query head its group's copy), as in",
        "TransformerLens 3's `ungroup_grouped_query_attention`.",
        "",
        "| name | shape | models | note |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| `{row.name}` | [{', '.join(row.shape)}] | {row.models} | {row.note} |")
    lines += ["", "Generated from these configurations (n_layers=2, GQA but for latent attention; sizes: "
              + ", ".join(f"{name}={size}" for name, size in DIMENSIONS.items() if name != "1") + "):", ""]
    for label, model in models.items():
        lines.append(f"- {label}: `{_config_summary(model.cfg)}`")
    lines += ["", *hook_points_markdown()]  # an SAE's hook points, which join a model's while it is spliced in
    return "\n".join(lines).rstrip("\n") + "\n"


def _config_summary(cfg: ModelConfig) -> str:
    fields = ("positional", "normalization", "norm_placement", "gated_mlp", "attn_only", "num_experts",
              "experts_per_token", "attn_bias", "mlp_bias", "act_fn")
    optional = ("qk_norm", "attn_scores_soft_cap", "output_logits_soft_cap", "embed_norm", "parallel_attn_mlp",
                "differential_lambda_init")
    # Shown where they differ from ModelConfig's defaults (rotary_dim defaults to d_head).
    not_default = ("n_key_value_heads", "rotary_dim", "attn_sinks", "layer_overrides")
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    defaults.update(n_key_value_heads=DIMENSIONS["n_key_value_heads"], rotary_dim=cfg.d_head)
    shown = [f for f in fields] + [f for f in optional if getattr(cfg, f) not in (None, False)]
    shown += [f for f in not_default if getattr(cfg, f) != defaults[f]]
    summary = [f"{f}={getattr(cfg, f)!r}" for f in shown]
    for name in ("latent", "moe"):  # a sub-config's fields where they differ from its defaults
        sub_config = getattr(cfg, name)
        if sub_config is not None:
            summary += [f"{name}.{f.name}={getattr(sub_config, f.name)!r}" for f in dataclasses.fields(sub_config)
                        if getattr(sub_config, f.name) != f.default]
    return ", ".join(summary)


def _which_models(name: str, having: set[str], models: dict[str, Decoder]) -> str:
    matches = [label for label, applies in WHICH_MODELS
               if {m for m, model in models.items() if applies(model.cfg)} == having]
    if len(matches) != 1:
        raise ValueError(f"{name} fires in {sorted(having)}, which matches {len(matches)} WHICH_MODELS labels "
                         f"({matches}); add a reference model or a label so exactly one describes it")
    return matches[0]


def _merge_orders(orders: list[list[str]]) -> list[str]:
    """One list keeping each input's order: names new in a later list go just before the next known one."""
    merged: list[str] = []
    for order in orders:
        pending: list[str] = []
        for name in order:
            if name not in merged:
                pending.append(name)
            elif pending:
                at = merged.index(name)
                merged[at:at] = pending
                pending = []
        merged += pending
    return merged


def main() -> None:
    """Prints ``docs/hooks.md``.

    Example:
        python -m workbench.hook_table > docs/hooks.md
    """
    models = reference_models()
    print(render_markdown(hook_table(models), models), end="")


if __name__ == "__main__":
    main()
