"""What an ablation removes (``AblationTarget``: a head, a layer's attention or MLP output, a neuron, an
expert) and how (``METHODS``: zero, mean, resample).

Legend: H n_heads, M d_mlp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from experiments.sites import Site
from workbench.errors import InputError

Kind = Literal["head", "attn_layer", "mlp_layer", "neuron", "expert"]
Method = Literal["zero", "mean", "resample"]
KINDS: tuple[str, ...] = ("head", "attn_layer", "mlp_layer", "neuron", "expert")
METHODS: tuple[str, ...] = ("zero", "mean", "resample")


@dataclass(frozen=True)
class AblationTarget:
    """One thing to ablate: ``kind`` at ``layer``, with ``index`` the head, neuron or expert.

    Example:
        >>> AblationTarget("head", 3, 4).hook_name
        'blocks.3.attn.hook_z'
    """

    kind: Kind
    layer: int
    index: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"AblationTarget.kind must be one of {KINDS}, got {self.kind!r}")
        needs_index = self.kind in ("head", "neuron", "expert")
        if needs_index and self.index is None:
            raise InputError(f"AblationTarget of kind {self.kind!r} needs an index (which {self.kind})")
        if not needs_index and self.index is not None:
            raise InputError(f"AblationTarget of kind {self.kind!r} ablates the whole layer; index must be None")

    @property
    def hook_name(self) -> str:
        l = self.layer
        return {"head": f"blocks.{l}.attn.hook_z", "attn_layer": f"blocks.{l}.hook_attn_out",
                "mlp_layer": f"blocks.{l}.hook_mlp_out", "neuron": f"blocks.{l}.mlp.hook_post",
                "expert": f"blocks.{l}.mlp.hook_expert_weights"}[self.kind]

    @property
    def site(self) -> Site:
        """The slice this target's ablation writes (experts are ablated through the router instead).

        Example:
            >>> AblationTarget("neuron", 2, 7).site
            Site(hook_name='blocks.2.mlp.hook_post', position=None, index=7)
        """
        return Site(self.hook_name, index=self.index if self.kind in ("head", "neuron") else None)

    def check(self, cfg) -> None:
        """Raises InputError when this target does not exist in a model with config ``cfg``.

        Example:
            >>> AblationTarget("head", 1, 3).check(model.cfg)           # toy-attn-2l: 2 layers of 4 heads
            >>> AblationTarget("head", 1, 4).check(model.cfg)
            Traceback (most recent call last):
            ...
            workbench.errors.InputError: AblationTarget(kind='head', layer=1, index=4): index must be in 0..3
            >>> AblationTarget("mlp_layer", 0).check(model.cfg)
            Traceback (most recent call last):
            ...
            workbench.errors.InputError: AblationTarget(kind='mlp_layer', layer=0, index=None): this model is attention-only and has no MLP
        """
        if not 0 <= self.layer < cfg.n_layers:
            raise InputError(f"{self}: layer must be in 0..{cfg.n_layers - 1}")
        if self.kind in ("mlp_layer", "neuron", "expert") and cfg.attn_only:
            raise InputError(f"{self}: this model is attention-only and has no MLP")
        if self.kind == "neuron" and self.layer in cfg.moe_layers:
            raise InputError(f"{self}: a mixture-of-experts layer has no single neuron axis; ablate an expert")
        if self.kind == "expert" and not cfg.is_moe:
            raise InputError(f"{self}: this model has no mixture of experts (num_experts=0)")
        if self.kind == "expert" and self.layer not in cfg.moe_layers:
            raise InputError(f"{self}: layer {self.layer} is a dense MLP layer with no experts; "
                             f"the mixture-of-experts layers are {cfg.moe_layers}")
        experts = cfg.layer_values("num_experts")[self.layer] if self.kind == "expert" else None
        size = {"head": cfg.n_heads, "neuron": cfg.layer_values("d_mlp")[self.layer], "expert": experts}.get(self.kind)
        if size is not None and not 0 <= self.index < size:
            raise InputError(f"{self}: index must be in 0..{size - 1}")


def check_method(method: str) -> None:
    """Raises InputError unless ``method`` is one of ``METHODS``.

    Example:
        >>> check_method("mean")
    """
    if method not in METHODS:
        raise InputError(f"ablation method must be one of {METHODS}, got {method!r}")


