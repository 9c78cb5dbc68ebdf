"""An SAE's arithmetic, SAELens 6's to the operation (read from its ``saes/*.py``), as functions of the weights:
the generic parts (hook points, input normalisation, ``b_dec`` centring, decode, skip term) around the encode of the
SAE's architecture (its ``Encoding`` in ``workbench.sae.architectures``).

Shapes: inputs ``[..., d_in]``, features ``[..., d_sae]``, outputs ``[..., d_out]`` (``...`` any leading
axes; ``d_out`` is ``d_in`` for an SAE and the written hook's width for a transcoder).

Each function takes the hook points to fire as an argument (``Points``), so the same code runs hooked (the
SAE's own points) and clean (``IDENTITY``): the error term is the input minus the *clean* reconstruction,
so an edit of ``hook_sae_acts_post`` changes the output by exactly its decoded difference, as in SAELens.

Input normalisation keeps per-row statistics from the encode for the decode (``NormState``), which SAELens
keeps on the module between ``encode`` and ``decode``; here they are passed explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from jaxtyping import Float
from torch import Tensor, nn

from workbench.errors import InputError
from workbench.sae.architectures.base import HookFn, pre_activations

__all__ = ["IDENTITY", "NormState", "Points", "activate", "decode", "encode", "full_codes", "pre_activations",
           "skip_term"]


def _identity(tensor: Tensor) -> Tensor:
    return tensor


@dataclass(frozen=True)
class Points:
    """The hook points an encode and decode fire, in order: input, pre-activations, features, reconstruction;
    then, in a full reconstruction, the error term and the output."""

    input: HookFn
    acts_pre: HookFn
    acts_post: HookFn
    recons: HookFn
    error: HookFn = _identity
    output: HookFn = _identity

    @classmethod
    def of(cls, points: dict) -> "Points":
        """The points named by SAELens's hook names (``hook_sae_input``, ...).

        Example:
            >>> Points.of({name: _identity for name in ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post",
            ...     "hook_sae_recons", "hook_sae_error", "hook_sae_output")}).output is _identity
            True
        """
        return cls(points["hook_sae_input"], points["hook_sae_acts_pre"], points["hook_sae_acts_post"],
                   points["hook_sae_recons"], points["hook_sae_error"], points["hook_sae_output"])

    def edits_possible(self) -> bool:
        """Whether a hook on the encode's or decode's points could change what they carry.

        Example:
            >>> IDENTITY.edits_possible()
            False
        """
        return any(getattr(point, "_forward_hooks", None) or getattr(point, "_forward_pre_hooks", None)
                   for point in (self.input, self.acts_pre, self.acts_post, self.recons))


IDENTITY = Points(_identity, _identity, _identity, _identity)


@dataclass
class NormState:
    """What an encode leaves for the decode: the rows' mean and std (``layer_norm``), their scale
    (``constant_norm_rescale``), the head size of a ``hook_z`` input (its heads are flattened), and the codes
    predicted from context (temporal; a full reconstruction decodes them with the features, ``decode`` does not)."""

    mean: Optional[Tensor] = None
    std: Optional[Tensor] = None
    scale: Optional[Tensor] = None
    d_head: Optional[int] = None
    predicted: Optional[Tensor] = None


def encode(sae: nn.Module, x: Float[Tensor, "... d_in"], points: Points = IDENTITY,
           ) -> tuple[Float[Tensor, "... d_sae"], NormState]:
    """Feature activations of ``x`` and the normalisation state the decode needs (SAELens's ``encode``).

    Example:
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=2),
        ...     {"W_enc": torch.eye(2), "W_dec": torch.eye(2), "b_enc": torch.tensor([0., -1.]), "b_dec": torch.zeros(2)})
        >>> encode(sae, torch.tensor([3., 0.5]))[0].detach()
        tensor([3., 0.])
    """
    cfg, spec = sae.cfg, sae.spec
    state = NormState()
    x = x.to(sae.W_dec.dtype)
    if cfg.reshape_activations == "hook_z":  # [..., heads, d_head] -> [..., heads * d_head]
        state.d_head = x.shape[-1]
        x = x.flatten(-2)
    x = points.input(x)
    x = _normalise_in(cfg, x, state)
    if cfg.apply_b_dec_to_input and not spec.transcoder:
        x = x - sae.b_dec
    features, state.predicted = spec.encoding.encode_with_predictions(sae, x, points.acts_pre)
    return points.acts_post(features), state


def full_codes(features: Float[Tensor, "... d_sae"], state: NormState) -> Float[Tensor, "... d_sae"]:
    """What a full reconstruction decodes: the features plus the codes the encode predicted from context, if any
    (SAELens's temporal ``forward`` decodes ``z_novel + z_pred``).

    Example:
        >>> full_codes(torch.ones(2), NormState(predicted=torch.tensor([0.5, 0.])))
        tensor([1.5000, 1.0000])
    """
    return features if state.predicted is None else features + state.predicted.to(features.dtype)


def activate(sae: nn.Module, hidden_pre: Float[Tensor, "... d_sae"]) -> Float[Tensor, "... d_sae"]:
    """The architecture's activation (its ``Encoding``: ``workbench.sae.architectures``) of pre-activations (not
    gated, whose activation needs the input: ``encode``); top-k with ``rescale_acts_by_decoder_norm`` chooses by
    pre-activation times decoder norm, as SAELens.

    Example:
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("jumprelu", d_in=2, d_sae=2), {"W_enc": torch.eye(2),
        ...     "W_dec": torch.eye(2), "b_enc": torch.zeros(2), "b_dec": torch.zeros(2), "threshold": torch.ones(2)})
        >>> activate(sae, torch.tensor([0.5, 2.0])).detach()
        tensor([0., 2.])
    """
    return sae.spec.encoding.activate(sae, hidden_pre)


def decode(sae: nn.Module, features: Float[Tensor, "... d_sae"], state: NormState, points: Points = IDENTITY,
           ) -> Float[Tensor, "... d_out"]:
    """The reconstruction of ``features`` (SAELens's ``decode``; a transcoder's output, without its skip term).

    Example:
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=2),
        ...     {"W_enc": torch.eye(2), "W_dec": 2 * torch.eye(2), "b_enc": torch.zeros(2), "b_dec": torch.ones(2)})
        >>> decode(sae, torch.tensor([1., 0.]), NormState()).detach()
        tensor([3., 1.])
    """
    cfg = sae.cfg
    features = features.to(sae.W_dec.dtype)
    if cfg.rescale_acts_by_decoder_norm and "rescale_acts_by_decoder_norm" in sae.spec.encoding.config_fields:
        features = features * (1 / sae.W_dec.norm(dim=-1))
    out = features @ sae.W_dec
    out = points.recons(out + sae.b_dec if sae.spec.encoding.adds_b_dec(cfg) else out)
    if sae.spec.transcoder:  # its output lives at another hook: no de-normalisation, no reshape
        return out
    out = _normalise_out(cfg, out, state)
    if state.d_head is not None:
        out = out.unflatten(-1, (-1, state.d_head))
    return out


def skip_term(sae: nn.Module, x: Float[Tensor, "... d_in"]) -> Optional[Float[Tensor, "... d_out"]]:
    """A skip transcoder's linear skip connection ``x W_skip^T``, added after the decode (None without one).

    Example:
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=2), {"W_enc": torch.eye(2),
        ...     "W_dec": torch.eye(2), "b_enc": torch.zeros(2), "b_dec": torch.zeros(2)})
        >>> skip_term(sae, torch.ones(2)) is None
        True
    """
    if not sae.spec.skip:
        return None
    return x.to(sae.W_skip.dtype) @ sae.W_skip.T


def _normalise_in(cfg: Any, x: Tensor, state: NormState) -> Tensor:
    """SAELens's run-time input normalisation (``expected_average_only_in`` is folded into the weights before an
    SAE is saved for inference, so it is the identity here, as there; ``constant_scalar_rescale``, temporal's, is
    times the config's ``activation_normalization_factor``)."""
    mode = cfg.normalize_activations
    if mode == "constant_scalar_rescale":
        return x * cfg.activation_normalization_factor
    if mode == "constant_norm_rescale":
        state.scale = cfg.d_in ** 0.5 / x.norm(dim=-1, keepdim=True)
        return x * state.scale
    if mode == "layer_norm":
        state.mean = x.mean(dim=-1, keepdim=True)
        x = x - state.mean
        state.std = x.std(dim=-1, keepdim=True)
        return x / (state.std + 1e-5)
    return x


def _normalise_out(cfg: Any, x: Tensor, state: NormState) -> Tensor:
    mode = cfg.normalize_activations
    if mode == "constant_scalar_rescale":
        return x / cfg.activation_normalization_factor
    if mode == "constant_norm_rescale":
        _need(state.scale, mode)
        return x / state.scale
    if mode == "layer_norm":
        _need(state.std, mode)
        return x * state.std + state.mean
    return x


def _need(statistic: Optional[Tensor], mode: str) -> None:
    if statistic is None:
        raise InputError(f"this SAE normalises its input ({mode!r}): decode needs the statistics of an encode, so "
                         "call encode first (as in SAELens) or use sae(x)")
