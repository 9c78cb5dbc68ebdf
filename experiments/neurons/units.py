"""Where an MLP neuron lives (``MLPUnit``), its activations on a prompt and its direct effect on the logits
(the package docstring, ``experiments.neurons``, says how each is read)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from experiments._tokens import str_tokens
from workbench.tokens_api import TextOrTokens
from experiments.lens import promoted_and_suppressed
from workbench.errors import InputError
from workbench.readouts import mlp_width

@dataclass(frozen=True)
class MLPUnit:
    """One MLP's neurons: layer ``layer``'s dense MLP, its routed ``expert``, or its ``shared`` expert.

    Example:
        >>> MLPUnit(3).label, MLPUnit(1, expert=2).label, MLPUnit(1, shared=True).label
        ('L3 MLP', 'L1 expert 2', 'L1 shared expert')
    """

    layer: int
    expert: Optional[int] = None
    shared: bool = False

    @property
    def label(self) -> str:
        if self.shared:
            return f"L{self.layer} shared expert"
        return f"L{self.layer} MLP" if self.expert is None else f"L{self.layer} expert {self.expert}"

    def width(self, cfg) -> int:
        """The number of neurons; ``InputError`` when the model has no such MLP.

        Example:
            >>> MLPUnit(1, expert=2).width(wb.load_model("toy-moe-2l", progress=False).cfg)
            256
            >>> MLPUnit(0).width(model.cfg)   # toy-attn-2l
            Traceback (most recent call last):
            workbench.errors.InputError: this model is attention-only: it has no MLP, so no neurons (open a model with MLPs)
        """
        return mlp_width(cfg, self.layer, self.expert, self.shared)


def mlp_units(model) -> list[MLPUnit]:
    """Every MLP whose neurons can be read: dense layers, each routed expert and each shared expert.

    Raises ``InputError`` for an attention-only model.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> [u.label for u in mlp_units(moe_model)][:5]
        ['L0 expert 0', 'L0 expert 1', 'L0 expert 2', 'L0 expert 3', 'L1 expert 0']
    """
    cfg = model.cfg
    if cfg.attn_only:
        MLPUnit(0).width(cfg)  # raises the message
    units = []
    for layer, n_experts in enumerate(cfg.layer_values("num_experts")):
        if not n_experts:
            units.append(MLPUnit(layer))
            continue
        units += [MLPUnit(layer, expert=e) for e in range(n_experts)]
        if cfg.moe.d_shared_expert:
            units.append(MLPUnit(layer, shared=True))
    return units


def _mlp_input_hook(cfg, layer: int) -> str:
    if cfg.parallel_attn_mlp or cfg.norm_placement in ("pre", "sandwich"):
        return f"blocks.{layer}.ln2.hook_normalized"
    return f"blocks.{layer}.hook_resid_mid"


def _hook_names(cfg, unit: MLPUnit) -> list[str]:
    l = unit.layer
    if unit.shared:
        return [f"blocks.{l}.mlp.shared.hook_post"]
    if unit.expert is None:
        return [f"blocks.{l}.mlp.hook_post"]
    return [_mlp_input_hook(cfg, l), f"blocks.{l}.mlp.hook_expert_indices"]


@torch.no_grad()
def unit_activations(model, tokens: TextOrTokens, unit: MLPUnit
                     ) -> tuple[Float[Tensor, "batch pos d_mlp"], Bool[Tensor, "batch pos"]]:
    """Every neuron of ``unit`` on every token (float32), and which tokens ran it (all, but for a routed
    expert: those the router sent to it; the others' activations are NaN). Runs the blocks up to ``unit.layer``.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> acts_BPM, routed_BP = unit_activations(moe_model, "The cat sat", MLPUnit(1, expert=2))
        >>> acts_BPM.shape, routed_BP.shape
        (torch.Size([1, 6, 256]), torch.Size([1, 6]))
        >>> bool(acts_BPM[~routed_BP].isnan().all()), bool(acts_BPM[routed_BP].isfinite().all())
        (True, True)
    """
    unit.width(model.cfg)
    tokens_BP = model.as_tokens(tokens)
    kept: dict[str, Tensor] = {}

    def keep(activation: Tensor, hook) -> None:
        kept[hook.name] = activation.detach()

    names = _hook_names(model.cfg, unit)
    model.run_with_hooks(tokens_BP, stop_at_layer=unit.layer + 1, fwd_hooks=[(name, keep) for name in names])
    if unit.expert is None:
        acts_BPM = kept[names[0]].float()
        return acts_BPM, torch.ones(acts_BPM.shape[:2], dtype=torch.bool, device=acts_BPM.device)
    x_BPD, indices_BPk = kept[names[0]], kept[names[1]]
    B, P, D = x_BPD.shape
    acts_BPM = model.expert_hidden(unit.layer, unit.expert, x_BPD.reshape(B * P, D)).float().reshape(B, P, -1)
    routed_BP = (indices_BPk == unit.expert).any(-1)
    return acts_BPM.masked_fill(~routed_BP[..., None], math.nan), routed_BP


def neuron_activation(model, tokens: TextOrTokens, unit: MLPUnit, neuron: int) -> pd.DataFrame:
    """One neuron on each token of the prompt (batch row 0): DataFrame[position, token, activation, routed].

    ``activation`` is NaN where a routed expert did not run (``routed`` False).

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> acts = neuron_activation(moe_model, "The cat sat", MLPUnit(1, expert=2), 17)
        >>> list(acts.columns), list(acts.token)
        (['position', 'token', 'activation', 'routed'], ['<|endoftext|>', 'The', ' c', 'at', ' s', 'at'])
        >>> bool(acts.activation.isna().eq(~acts.routed).all())   # NaN exactly where the expert did not run
        True
    """
    _check_neuron(model, unit, neuron)
    tokens_1P = model.as_tokens(tokens)[:1]
    acts_BPM, routed_BP = unit_activations(model, tokens_1P, unit)
    return pd.DataFrame({"position": range(tokens_1P.shape[1]), "token": str_tokens(model, tokens_1P[0].cpu()),
                         "activation": acts_BPM[0, :, neuron].cpu().numpy(), "routed": routed_BP[0].cpu().numpy()})


def _check_neuron(model, unit: MLPUnit, neuron: int) -> None:
    width = unit.width(model.cfg)
    if not 0 <= neuron < width:
        raise InputError(f"{unit.label} has neurons 0..{width - 1}, got {neuron}")


def output_weights(model, unit: MLPUnit) -> Float[Tensor, "d_mlp d_model"]:
    """``unit``'s W_out [M, D]: the direction each neuron writes to the residual stream.

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> output_weights(moe_model, MLPUnit(1, expert=3)).shape
        torch.Size([256, 128])
    """
    return model.layer_W_out(unit.layer, unit.expert, unit.shared)


@torch.no_grad()
def direct_logit_effect(model, unit: MLPUnit, neuron: int, k: int = 10, through_final_norm: bool = True) -> pd.DataFrame:
    """The ``k`` tokens one unit of the neuron's activation promotes most and suppresses most, directly.

    effect = W_out[neuron] @ W_U, through the final norm's gain when ``through_final_norm`` (see the
    module docstring). DataFrame[direction ("promoted" / "suppressed"), rank, token, token_id, effect].

    Example:
        >>> moe_model = wb.load_model("toy-moe-2l", progress=False)   # 2 layers of 4 experts, d_mlp 256
        >>> effect = direct_logit_effect(moe_model, MLPUnit(1, expert=0), 100, k=3)
        >>> effect[["direction", "rank"]].values.tolist()
        [['promoted', 1], ['promoted', 2], ['promoted', 3], ['suppressed', 1], ['suppressed', 2], ['suppressed', 3]]
        >>> bool(effect.effect.iloc[0] >= effect.effect.iloc[1] > 0 > effect.effect.iloc[-1])
        True
    """
    _check_neuron(model, unit, neuron)
    out_D = output_weights(model, unit)[neuron]
    if through_final_norm:
        unit_scale = torch.ones(1, 1, dtype=out_D.dtype, device=out_D.device)
        out_D = model.apply_final_norm(out_D[None], frozen_scale=unit_scale)[0]
    return promoted_and_suppressed(model, out_D.float() @ model.W_U.float(), k)
