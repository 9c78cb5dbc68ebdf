"""Mixture-of-experts layers in HF checkpoints: which layers have experts, the router's config values, and
the expert tensors in every spelling transformers writes.

Legend: E num_experts, M d_mlp, D d_model.

Each MoE family names its flavour (``MOE_KINDS``); the flavour says how config.json describes the
router and where the experts sit. Layer by layer (``moe_layer_fields``), a layer with experts gets the
experts' width as its ``d_mlp``, a dense one (DeepSeek's first ``first_k_dense_replace`` layers,
Qwen-MoE's ``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips) ``intermediate_size`` and
no experts.

Expert tensors (``read_experts``) come per expert, as ``save_pretrained`` writes them
(``{prefix}.experts.{e}.{gate,up,down}_proj.weight``; Mixtral's ``w1``/``w3``/``w2``), or fused as
transformers holds them in memory (``mlp.experts.gate_up_proj`` [E, 2M, D], gate rows first, and
``down_proj`` [E, D, M], the router at ``mlp.gate``); gpt-oss's are fused, transposed and interleaved (``gate_up_proj`` [E, D, 2M]
with gate columns at even indices, ``down_proj`` [E, M, D], each with a bias); GraniteMoE's are fused under
their own names (``block_sparse_moe.input_linear`` [E, 2M, D], ``output_linear`` [E, D, M], ``MoEKind.fused_names``).
The other Llama-like mixtures (OLMoE, MiniMax-M2, GLM-4.5 and dots.llm1, ERNIE 4.5, HunYuan, Phi-3.5-MoE, GraniteMoE) are
rows of the same table, read by ``moe_families``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from workbench.config import ModelConfig
from workbench.errors import CheckpointError
from workbench.loading.hf.checkpoint import SafetensorsCheckpoint
from workbench.loading.hf.config import HFConfig, per_layer_config, per_layer_values


@dataclass(frozen=True)
class MoEKind:
    """How one family's config.json and checkpoint describe its experts."""

    experts_field: tuple[str, ...]  # the config fields holding the expert count (the first present wins)
    width_field: str  # one expert's width
    # MoEConfig fields from config.json (renormalisation, scoring, shared expert ...).
    router: Callable[[HFConfig], dict[str, Any]]
    per_expert: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # our gate, in, out
    router_tensor: str = "mlp.gate"  # under model.layers.{l}
    experts_prefix: str = "mlp.experts"
    shared_prefix: Optional[str] = None  # the shared expert's MLP under model.layers.{l}
    sparse_layers: str = "every"  # which layers have experts: a key of SPARSE_LAYER_RULES
    interleaved: bool = False  # gpt-oss's fused, transposed, interleaved and biased expert tensors
    k_field: str = "num_experts_per_tok"  # the config field holding k (HunYuan: moe_topk; ERNIE: moe_k)
    # The correction bias under model.layers.{l} (ERNIE's is [1, E]); None: {router}.e_score_correction_bias.
    correction_tensor: Optional[str] = None
    # Experts stored fused under these names (under model.layers.{l}): [E, 2M, D] with gate rows first and
    # [E, D, M] (GraniteMoE's input_linear / output_linear); None: per expert (or transformers' in-memory layout).
    fused_names: Optional[tuple[str, str]] = None
    shared_fused: bool = False  # the shared expert's gate and up projections in one input_linear (GraniteMoE)


def _qwen_router(hf: HFConfig) -> dict[str, Any]:
    return {"router_renormalize": bool(hf.get("norm_topk_prob", False))}


def _qwen2_moe_router(hf: HFConfig) -> dict[str, Any]:
    shared = int(hf.get("shared_expert_intermediate_size", 0))
    return {**_qwen_router(hf), "d_shared_expert": shared, "shared_expert_gate": shared > 0}


def _gpt_oss_router(hf: HFConfig) -> dict[str, Any]:
    return {"router_scoring": "topk_softmax", "router_bias": True, "expert_bias": True,
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)), "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702))}


def _sigmoid_router(hf: HFConfig) -> dict[str, Any]:
    """MiniMax-M2: sigmoid scores plus a correction bias choose, the chosen scores renormalised weigh."""
    return {"router_scoring": "sigmoid", "router_score_correction": True, "router_renormalize": True}


def _grouped_sigmoid_router(hf: HFConfig) -> dict[str, Any]:
    """GLM-4.5 (glm4_moe), dots.llm1: DeepSeek-V3's routing (groups scored by their best two, correction
    bias, norm_topk_prob, routed_scaling_factor, float32 router) and n_shared_experts shared experts."""
    return {"router_scoring": "sigmoid", "router_score_correction": True, "router_group_score": "top2_sum",
            "router_renormalize": bool(hf.get("norm_topk_prob", True)), **router_groups(hf),
            "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)), "router_in_float32": True,
            "d_shared_expert": int(hf.require("moe_intermediate_size")) * int(hf.get("n_shared_experts", 0))}


def _ernie_router(hf: HFConfig) -> dict[str, Any]:
    """ERNIE 4.5: softmax probabilities plus a correction bias choose; the sum is clamped at moe_norm_min."""
    return {"router_score_correction": True, "router_renormalize": True, "router_in_float32": True,
            "router_renormalize_floor": float(hf.get("moe_norm_min", 1e-12)),
            "d_shared_expert": int(hf.require("moe_intermediate_size")) * int(hf.get("moe_num_shared_experts", 0))}


def _hunyuan_router(hf: HFConfig) -> dict[str, Any]:
    """HunYuan-MoE: renormalised softmax in float32, and one ungated shared MLP of intermediate_size."""
    return {"router_renormalize": True, "router_in_float32": True, "d_shared_expert": int(hf.require("intermediate_size"))}


def _granite_router(hf: HFConfig) -> dict[str, Any]:
    """GraniteMoE (-Shared): the top k of the logits, a softmax over those; a shared MLP of shared_intermediate_size."""
    return {"router_scoring": "topk_softmax", "d_shared_expert": int(hf.get("shared_intermediate_size", 0))}


def _sparsemixer_router(hf: HFConfig) -> dict[str, Any]:
    """Phi-3.5-MoE: sparsemixer over the logits, its threshold router_jitter_noise."""
    return {"router_scoring": "sparsemixer", "router_jitter_eps": float(hf.get("router_jitter_noise", 0.01))}


_PER_EXPERT_W123 = dict(per_expert=("w1", "w3", "w2"), router_tensor="block_sparse_moe.gate",
                        experts_prefix="block_sparse_moe.experts")

MOE_KINDS: dict[str, MoEKind] = {
    "mixtral": MoEKind(("num_local_experts",), "intermediate_size", lambda hf: {"router_renormalize": True},
                       per_expert=("w1", "w3", "w2"), router_tensor="block_sparse_moe.gate",
                       experts_prefix="block_sparse_moe.experts"),
    "qwen2_moe": MoEKind(("num_experts", "num_local_experts"), "moe_intermediate_size", _qwen2_moe_router,
                         shared_prefix="mlp.shared_expert", sparse_layers="decoder_sparse_step"),
    "qwen3_moe": MoEKind(("num_experts", "num_local_experts"), "moe_intermediate_size", _qwen_router,
                         sparse_layers="decoder_sparse_step"),
    "gpt_oss": MoEKind(("num_local_experts", "num_experts"), "intermediate_size", _gpt_oss_router,
                       router_tensor="mlp.router", interleaved=True),
    # ---- the Llama-like mixtures of experts (moe_families) ----
    "olmoe": MoEKind(("num_experts",), "intermediate_size", _qwen_router),
    "minimax_m2": MoEKind(("num_local_experts",), "intermediate_size", _sigmoid_router, **_PER_EXPERT_W123,
                          correction_tensor="block_sparse_moe.e_score_correction_bias"),
    "grouped_sigmoid": MoEKind(("n_routed_experts",), "moe_intermediate_size", _grouped_sigmoid_router,
                               shared_prefix="mlp.shared_experts", sparse_layers="first_k_dense_replace"),
    "ernie4_5_moe": MoEKind(("moe_num_experts",), "moe_intermediate_size", _ernie_router, k_field="moe_k",
                            shared_prefix="mlp.shared_experts", sparse_layers="moe_layer_interval",
                            correction_tensor="mlp.moe_statics.e_score_correction_bias"),
    "hunyuan_v1_moe": MoEKind(("num_experts",), "intermediate_size", _hunyuan_router, k_field="moe_topk",
                              router_tensor="mlp.gate.wg", shared_prefix="mlp.shared_mlp"),
    "phimoe": MoEKind(("num_local_experts",), "intermediate_size", _sparsemixer_router, **_PER_EXPERT_W123),
    "granitemoe": MoEKind(("num_local_experts",), "intermediate_size", _granite_router,
                          router_tensor="block_sparse_moe.router.layer", shared_prefix="shared_mlp", shared_fused=True,
                          fused_names=("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight")),
}


def _every_layer(hf: HFConfig, n_layers: int) -> list[bool]:
    return [True] * n_layers


def _first_k_dense(hf: HFConfig, n_layers: int) -> list[bool]:
    """DeepSeek: the first ``first_k_dense_replace`` layers are dense."""
    return [layer >= int(hf.get("first_k_dense_replace", 0)) for layer in range(n_layers)]


def _decoder_sparse_step(hf: HFConfig, n_layers: int) -> list[bool]:
    """Qwen2/3-MoE: experts where (layer + 1) % decoder_sparse_step == 0, except ``mlp_only_layers``."""
    step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers", []))
    if step < 1:
        raise hf.refuse("decoder_sparse_step", step, "must be a positive integer")
    return [layer not in dense and (layer + 1) % step == 0 for layer in range(n_layers)]


def _moe_layer_interval(hf: HFConfig, n_layers: int) -> list[bool]:
    """ERNIE 4.5: experts on every ``moe_layer_interval``-th layer (counting from 1) between
    ``moe_layer_start_index`` and ``moe_layer_end_index`` (-1: the last layer), both included."""
    interval, start = int(hf.get("moe_layer_interval", 1)), int(hf.get("moe_layer_start_index", 1))
    end = int(hf.get("moe_layer_end_index", -1))
    end = n_layers - 1 if end == -1 else end
    if interval < 1:
        raise hf.refuse("moe_layer_interval", interval, "must be a positive integer")
    return [(layer + 1) % interval == 0 and start <= layer <= end for layer in range(n_layers)]


SPARSE_LAYER_RULES: dict[str, Callable[[HFConfig, int], list[bool]]] = {
    "every": _every_layer, "first_k_dense_replace": _first_k_dense, "decoder_sparse_step": _decoder_sparse_step,
    "moe_layer_interval": _moe_layer_interval,
}


def router_groups(hf: HFConfig, experts_field: str = "n_routed_experts") -> dict[str, Any]:
    """Group-limited routing's ``router_groups`` / ``router_topk_groups`` from ``n_group`` / ``topk_group``
    (DeepSeek-V2/V3, GLM-4.5, dots.llm1), each checked against the expert count.

    Example:
        >>> router_groups(HFConfig({"n_routed_experts": 64, "n_group": 8, "topk_group": 4}, "config.json"))
        {'router_groups': 8, 'router_topk_groups': 4}
        >>> router_groups(HFConfig({"n_routed_experts": 64, "n_group": 6, "topk_group": 4}, "config.json"))
        Traceback (most recent call last):
        workbench.errors.ConfigError: config.json: field 'n_group' = 6 cannot be honoured: must divide n_routed_experts=64
    """
    n_group, topk_group = int(hf.require("n_group")), int(hf.require("topk_group"))
    if n_group < 1:
        raise hf.refuse("n_group", n_group, "must be a positive integer")
    if not 0 < topk_group <= n_group:
        raise hf.refuse("topk_group", topk_group, f"must be in 1..n_group={n_group}")
    n_experts = int(hf.require(experts_field))
    if n_experts % n_group:
        raise hf.refuse("n_group", n_group, f"must divide {experts_field}={n_experts}")
    return {"router_groups": n_group, "router_topk_groups": topk_group}


def expert_count(hf: HFConfig, kind: MoEKind) -> int:
    """The number of routed experts (a ``ConfigError`` naming the field when it is missing).

    Example:
        >>> expert_count(HFConfig({"num_local_experts": 8}, "config.json"), MOE_KINDS["qwen3_moe"])   # the second spelling
        8
    """
    for name in kind.experts_field:
        if hf.get(name) is not None:
            return int(hf.get(name))
    return int(hf.require(kind.experts_field[0]))


def moe_layer_fields(hf: HFConfig, kind: MoEKind, n_layers: int) -> list[dict[str, Any]]:
    """Per layer: ``num_experts``, ``experts_per_token`` and ``d_mlp`` (for ``per_layer_config``).

    Example:
        >>> hf = HFConfig({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        ...                "intermediate_size": 32, "mlp_only_layers": [0]}, "config.json")
        >>> [f["num_experts"] for f in moe_layer_fields(hf, MOE_KINDS["qwen3_moe"], 2)]
        [0, 4]
    """
    E, k = expert_count(hf, kind), hf.require(kind.k_field)
    if isinstance(k, bool) or not isinstance(k, int):  # HunYuan allows a list, one k per layer
        raise hf.refuse(kind.k_field, k, "expected one integer for every layer")
    width, dense_width = int(hf.require(kind.width_field)), int(hf.require("intermediate_size"))
    if not 0 < k <= E:
        raise hf.refuse(kind.k_field, k, f"must be in 1..{E} (the number of experts)")
    sparse = SPARSE_LAYER_RULES[kind.sparse_layers](hf, n_layers) if E else [False] * n_layers
    return [{"num_experts": E, "experts_per_token": k, "d_mlp": width} if is_sparse
            else {"num_experts": 0, "experts_per_token": 0, "d_mlp": dense_width} for is_sparse in sparse]


def with_moe_layers(fields: dict[str, Any], mlp_layers: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-layer ``fields`` (as ``per_layer_config`` gives them, e.g. attention's) joined with each layer's
    MLP fields, the model-level values taken from the first MoE layer (so ``cfg.num_experts`` counts
    experts even where the first layers are dense).

    Example:
        >>> with_moe_layers({"sliding_window": None}, [{"num_experts": 0, "experts_per_token": 0, "d_mlp": 32},
        ...                                            {"num_experts": 4, "experts_per_token": 2, "d_mlp": 8}])["num_experts"]
        4
    """
    layers = [{**own, **mlp} for own, mlp in zip(per_layer_values(fields, len(mlp_layers)), mlp_layers)]
    return per_layer_config(layers, base=next((l for l, mlp in enumerate(mlp_layers) if mlp["num_experts"]), 0))


def read_experts(ckpt: SafetensorsCheckpoint, kind: MoEKind, cfg: ModelConfig, layer: int) -> dict[str, Tensor]:
    """Router, stacked experts and shared expert of one MoE layer (``cfg`` is that layer's), renamed to ours.

    Example:
        >>> read_experts(ckpt, MOE_KINDS["qwen3_moe"], cfg.for_layer(1), 1)   # doctest: +SKIP
    """
    E, M, D = cfg.num_experts, cfg.d_mlp, cfg.d_model
    hf_layer, ours = f"model.layers.{layer}", f"blocks.{layer}.mlp"
    fused = not kind.interleaved and ckpt.has(f"{hf_layer}.mlp.experts.gate_up_proj")  # transformers' in-memory layout
    router = f"{hf_layer}.{'mlp.gate' if fused else kind.router_tensor}"
    out = {f"{ours}._W_router_lin": ckpt.take(f"{router}.weight", (E, D))}
    if cfg.moe.router_bias:
        out[f"{ours}.b_router"] = ckpt.take(f"{router}.bias", (E,))
    if cfg.moe.router_score_correction:
        name = f"{hf_layer}.{kind.correction_tensor}" if kind.correction_tensor else f"{router}.e_score_correction_bias"
        out[f"{ours}.router_score_correction"] = ckpt.take(name).float().reshape(-1)
        if out[f"{ours}.router_score_correction"].shape != (E,):
            raise CheckpointError(f"{ckpt.source}: tensor '{name}' holds "
                                  f"{out[f'{ours}.router_score_correction'].numel()} values, expected {E} (one per expert)")
    experts = f"{hf_layer}.{kind.experts_prefix}"
    if kind.fused_names is not None:
        gate_up_E2MD = ckpt.take(f"{hf_layer}.{kind.fused_names[0]}", (E, 2 * M, D))
        out.update({f"{ours}._W_gate_lin": gate_up_E2MD[:, :M], f"{ours}._W_in_lin": gate_up_E2MD[:, M:],
                    f"{ours}._W_out_lin": ckpt.take(f"{hf_layer}.{kind.fused_names[1]}", (E, D, M))})
    elif kind.interleaved:
        out.update(_interleaved_experts(ckpt, experts, ours, E, M, D))
    elif fused:
        gate_up_E2MD = ckpt.take(f"{hf_layer}.mlp.experts.gate_up_proj", (E, 2 * M, D))
        out.update({f"{ours}._W_gate_lin": gate_up_E2MD[:, :M], f"{ours}._W_in_lin": gate_up_E2MD[:, M:],
                    f"{ours}._W_out_lin": ckpt.take(f"{hf_layer}.mlp.experts.down_proj", (E, D, M))})
    else:
        for hf_name, name, shape in zip(kind.per_expert, ("_W_gate_lin", "_W_in_lin", "_W_out_lin"),
                                        ((M, D), (M, D), (D, M))):
            out[f"{ours}.{name}"] = torch.stack([ckpt.take(f"{experts}.{e}.{hf_name}.weight", shape)
                                                for e in range(E)])
    if cfg.moe.d_shared_expert:
        shared = f"{hf_layer}.{kind.shared_prefix}"
        if kind.shared_fused:
            out.update(fused_gated_mlp(ckpt, shared, f"{ours}.shared", cfg.moe.d_shared_expert, D,
                                       names=("input_linear", "output_linear")))
        else:
            out.update(dense_gated_mlp(ckpt, shared, f"{ours}.shared", cfg.moe.d_shared_expert, D, bias=cfg.mlp_bias))
        if cfg.moe.shared_expert_gate:
            out[f"{ours}._W_shared_gate_lin"] = ckpt.take(f"{shared}_gate.weight", (1, D))
    return out


def dense_gated_mlp(ckpt: SafetensorsCheckpoint, prefix: str, ours: str, M: int, D: int,
                    bias: bool = False) -> dict[str, Tensor]:
    """A gated MLP's ``{prefix}.{gate,up,down}_proj`` weights (and biases) as ``{ours}._W_{gate,in,out}_lin``.

    Example:
        >>> dense_gated_mlp(ckpt, "model.layers.0.mlp", "blocks.0.mlp", 80, 48)   # doctest: +SKIP
    """
    out = {}
    for proj, name, shape in (("gate", "gate", (M, D)), ("up", "in", (M, D)), ("down", "out", (D, M))):
        out[f"{ours}._W_{name}_lin"] = ckpt.take(f"{prefix}.{proj}_proj.weight", shape)
        if bias:
            out[f"{ours}.b_{name}"] = ckpt.take(f"{prefix}.{proj}_proj.bias", shape[:1])
    return out


def fused_gated_mlp(ckpt: SafetensorsCheckpoint, prefix: str, ours: str, M: int, D: int,
                    names: tuple[str, str] = ("gate_up_proj", "down_proj")) -> dict[str, Tensor]:
    """GLM: ``gate_up_proj`` [2M, D] (gate rows first) and ``down_proj`` [D, M], no biases, as ``{ours}._W_{gate,in,out}_lin``
    (GraniteMoE's shared expert: the same as ``input_linear`` and ``output_linear``).

    Example:
        >>> fused_gated_mlp(ckpt, "model.layers.0.mlp", "blocks.0.mlp", 80, 48)   # doctest: +SKIP
    """
    gate_up_2MD = ckpt.take(f"{prefix}.{names[0]}.weight", (2 * M, D))
    return {f"{ours}._W_gate_lin": gate_up_2MD[:M], f"{ours}._W_in_lin": gate_up_2MD[M:],
            f"{ours}._W_out_lin": ckpt.take(f"{prefix}.{names[1]}.weight", (D, M))}


def dense_mlp(ckpt: SafetensorsCheckpoint, prefix: str, ours: str, M: int, D: int, bias: bool,
               act_fn: str) -> dict[str, Tensor]:
    """Nemotron, Arcee, Apertus: ``up_proj`` [M, D] and ``down_proj`` [D, M] around the activation (no gate),
    with biases when ``bias``, and xIELU's scalars (``act_fn.*``) when that is the activation.

    Example:
        >>> dense_mlp(ckpt, "model.layers.0.mlp", "blocks.0.mlp", 80, 48, False, "relu2")   # doctest: +SKIP
    """
    out = {}
    for proj, name, shape in (("up", "in", (M, D)), ("down", "out", (D, M))):
        out[f"{ours}._W_{name}_lin"] = ckpt.take(f"{prefix}.{proj}_proj.weight", shape)
        if bias:
            out[f"{ours}.b_{name}"] = ckpt.take(f"{prefix}.{proj}_proj.bias", shape[:1])
    if act_fn == "xielu":  # Apertus: the activation's own scalars
        out.update({f"{ours}.act.{name}": ckpt.take(f"{prefix}.act_fn.{name}", shape)
                    for name, shape in (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ()))})
    return out


def _interleaved_experts(ckpt: SafetensorsCheckpoint, prefix: str, ours: str, E: int, M: int, D: int) -> dict[str, Tensor]:
    """gpt-oss: ``gate_up_proj`` [E, D, 2M] (gate at even columns, up at odd) and ``down_proj`` [E, M, D],
    both used as x @ W (transposed against nn.Linear), each with a bias."""
    gate_up_ED2M = ckpt.take(f"{prefix}.gate_up_proj", (E, D, 2 * M))
    gate_up_bias_E2M = ckpt.take(f"{prefix}.gate_up_proj_bias", (E, 2 * M))
    return {f"{ours}._W_gate_lin": gate_up_ED2M[..., 0::2].transpose(1, 2).contiguous(),
            f"{ours}._W_in_lin": gate_up_ED2M[..., 1::2].transpose(1, 2).contiguous(),
            f"{ours}.b_gate": gate_up_bias_E2M[:, 0::2].contiguous(),
            f"{ours}.b_in": gate_up_bias_E2M[:, 1::2].contiguous(),
            f"{ours}._W_out_lin": ckpt.take(f"{prefix}.down_proj", (E, M, D)).transpose(1, 2).contiguous(),
            f"{ours}.b_out": ckpt.take(f"{prefix}.down_proj_bias", (E, D))}
