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
with gate columns at even indices, ``down_proj`` [E, M, D], each with a bias).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from workbench.config import ModelConfig
from workbench.loading.hf_checkpoint import SafetensorsCheckpoint
from workbench.loading.hf_common import HFConfig, per_layer_config, per_layer_values


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


def _qwen_router(hf: HFConfig) -> dict[str, Any]:
    return {"router_renormalize": bool(hf.get("norm_topk_prob", False))}


def _qwen2_moe_router(hf: HFConfig) -> dict[str, Any]:
    shared = int(hf.get("shared_expert_intermediate_size", 0))
    return {**_qwen_router(hf), "d_shared_expert": shared, "shared_expert_gate": shared > 0}


def _gpt_oss_router(hf: HFConfig) -> dict[str, Any]:
    return {"router_scoring": "topk_softmax", "router_bias": True, "expert_bias": True,
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)), "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702))}


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


SPARSE_LAYER_RULES: dict[str, Callable[[HFConfig, int], list[bool]]] = {
    "every": _every_layer, "first_k_dense_replace": _first_k_dense, "decoder_sparse_step": _decoder_sparse_step,
}


def expert_count(hf: HFConfig, kind: MoEKind) -> int:
    """The number of routed experts (a ``ConfigError`` naming the field when it is missing)."""
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
    E, k = expert_count(hf, kind), int(hf.require("num_experts_per_tok"))
    width, dense_width = int(hf.require(kind.width_field)), int(hf.require("intermediate_size"))
    if not 0 < k <= E:
        raise hf.refuse("num_experts_per_tok", k, f"must be in 1..{E} (the number of experts)")
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
        out[f"{ours}.router_score_correction"] = ckpt.take(f"{router}.e_score_correction_bias", (E,)).float()
    experts = f"{hf_layer}.{kind.experts_prefix}"
    if kind.interleaved:
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


def fused_gated_mlp(ckpt: SafetensorsCheckpoint, prefix: str, ours: str, M: int, D: int) -> dict[str, Tensor]:
    """GLM: ``gate_up_proj`` [2M, D] (gate rows first) and ``down_proj`` [D, M], no biases, as ``{ours}._W_{gate,in,out}_lin``.

    Example:
        >>> fused_gated_mlp(ckpt, "model.layers.0.mlp", "blocks.0.mlp", 80, 48)   # doctest: +SKIP
    """
    gate_up_2MD = ckpt.take(f"{prefix}.gate_up_proj.weight", (2 * M, D))
    return {f"{ours}._W_gate_lin": gate_up_2MD[:M], f"{ours}._W_in_lin": gate_up_2MD[M:],
            f"{ours}._W_out_lin": ckpt.take(f"{prefix}.down_proj.weight", (D, M))}


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
