"""What every architecture shares: its table row (``ArchitectureSpec``), the bases of its inference encode
(``Encoding``) and of its training form (``TrainingForm``), and the encoder's affine map (``pre_activations``).

Legend: N flattened tokens, i d_in, X d_sae, o d_out.

(``X`` may be preceded by more feature axes where ``...`` is written: a cross-layer transcoder's ``[N, L, X]``.)

An architecture module (``standard``, ``jumprelu``, ...) subclasses ``Encoding`` with its activation and the
per-feature tensors it stores, and ``TrainingForm`` with what training adds (its state, activation, loss terms,
what it is saved as). Everything else is generic and reads these: ``wb.SAE`` and ``workbench.sae.math`` (hook
points, input normalisation, ``b_dec`` centring, decode, skip term), ``workbench.sae.tensors`` (the checks of a
file's tensors) and ``experiments.sae`` (initialisation of ``W_enc`` / ``W_dec``, the MSE, ``b_dec``, the loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Mapping, Optional

import torch
from jaxtyping import Float
from torch import Tensor, nn

Activation = Literal["relu", "jumprelu", "topk", "abstopk", "gated", "temporal", "matching_pursuit",
                     "batchtopk_threshold"]
HookFn = Callable[[Tensor], Tensor]
# A sparse decode: (feature indices [N, k], values [N, k]) -> the reconstruction [N, o] (no b_dec in the aux-k loss).
SparseDecode = Callable[[Tensor, Tensor], Tensor]


def pre_activations(sae: nn.Module, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_sae"]:
    """``x W_enc + b_enc`` (``x`` already centred and normalised; a transcoder's input as it is), in the weights'
    dtype: the encoder's affine map every architecture but gated applies before its activation.

    Example:
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=2),
        ...     {"W_enc": torch.eye(2), "W_dec": torch.eye(2), "b_enc": torch.tensor([0., -1.]), "b_dec": torch.zeros(2)})
        >>> pre_activations(sae, torch.tensor([3., 0.5])).detach()
        tensor([ 3.0000, -0.5000])
    """
    return x.to(sae.W_enc.dtype) @ sae.W_enc + sae.b_enc


class Encoding:
    """An architecture's inference encode beyond the generic parts: its activation's name, the per-feature tensors
    ``[d_sae]`` it stores beside ``W_enc``, ``W_dec`` and ``b_dec``, the config fields it owns, and ``activate``.
    ``sae`` is a ``wb.SAE`` (or a module holding its weights under SAELens's names)."""

    activation: ClassVar[str]
    weights: ClassVar[tuple[str, ...]] = ("b_enc",)
    # Scalar tensors ``[]`` it stores (a batch-top-k training checkpoint's ``topk_threshold``).
    scalars: ClassVar[tuple[str, ...]] = ()
    config_fields: ClassVar[tuple[str, ...]] = ()
    # Input normalisations of this architecture's beyond the generic ones (``SAEConfig.normalize_activations``).
    normalizations: ClassVar[tuple[str, ...]] = ()
    # Whether a code reads the positions before it (a temporal SAE's), so ``encode`` takes [batch, pos, d_in] only.
    reads_sequences: ClassVar[bool] = False

    def encode(self, sae: nn.Module, x: Float[Tensor, "... d_in"], acts_pre: HookFn) -> Float[Tensor, "... d_sae"]:
        """Feature activations of centred, normalised ``x`` (before ``hook_sae_acts_post``): the affine map,
        through ``acts_pre``, then ``activate``."""
        return self.activate(sae, acts_pre(pre_activations(sae, x)))

    def encode_with_predictions(self, sae: nn.Module, x: Float[Tensor, "... d_in"], acts_pre: HookFn,
                                ) -> tuple[Float[Tensor, "... d_sae"], Optional[Float[Tensor, "... d_sae"]]]:
        """(feature activations, codes predicted from context, or None where the architecture predicts none: every
        one but temporal). A full reconstruction decodes their sum; ``decode`` the features alone."""
        return self.encode(sae, x, acts_pre), None

    def check_config(self, cfg: Any) -> None:
        """Raises a ``ConfigError`` naming the field for a value of ``config_fields`` the encode cannot honour."""

    def stores_encoder(self, cfg: Any) -> bool:
        """Whether ``W_enc`` is stored (a tied-weights architecture encodes with ``W_dec`` transposed)."""
        return True

    def adds_b_dec(self, cfg: Any) -> bool:
        """Whether the decode adds ``b_dec``."""
        return True

    def submodules(self, cfg: Any, device: Any = None, dtype: Optional[torch.dtype] = None) -> dict[str, nn.Module]:
        """Modules the SAE holds beside its tensors (temporal's attention layers), by attribute name; their
        parameters are stored as ``<name>.<parameter>``, SAELens's state-dict names."""
        return {}

    def activate(self, sae: nn.Module, hidden_pre: Float[Tensor, "... d_sae"]) -> Float[Tensor, "... d_sae"]:
        """The activation of pre-activations ``hidden_pre``."""
        raise NotImplementedError(f"{type(self).__name__} defines no activate")


@dataclass(frozen=True)
class ArchitectureSpec:
    """One row of the table: an architecture's name, its encoding, whether it is a transcoder (reads one hook,
    writes another of width ``d_out``: no input centring, no output de-normalisation), whether it has ``W_skip``."""

    name: str
    encoding: Encoding
    transcoder: bool = False
    skip: bool = False

    @property
    def activation(self) -> Activation:
        """The activation's name: ``relu``, ``jumprelu``, ``topk`` or ``gated``."""
        return self.encoding.activation  # type: ignore[return-value]

    @property
    def top_k(self) -> bool:
        """Whether the config carries ``k`` and ``rescale_acts_by_decoder_norm``."""
        return "k" in self.encoding.config_fields

    def weight_shapes(self, d_in: int, d_sae: int, d_out: int, cfg: Any = None) -> dict[str, tuple[int, ...]]:
        """The tensors the architecture stores, by SAELens's names, with their shapes; with ``cfg`` (an
        ``SAEConfig``) also what depends on its own fields (an untied ``W_enc``, submodules' parameters).

        Example:
            >>> from workbench.sae.architectures import ARCHITECTURES
            >>> ARCHITECTURES["gated"].weight_shapes(16, 32, 16)   # doctest: +NORMALIZE_WHITESPACE
            {'W_enc': (16, 32), 'W_dec': (32, 16), 'b_dec': (16,), 'b_gate': (32,), 'b_mag': (32,), 'r_mag': (32,)}
        """
        shapes: dict[str, tuple[int, ...]] = {"W_enc": (d_in, d_sae), "W_dec": (d_sae, d_out), "b_dec": (d_out,)}
        if cfg is not None and not self.encoding.stores_encoder(cfg):
            del shapes["W_enc"]
        shapes.update((name, (d_sae,)) for name in self.encoding.weights)
        shapes.update((name, ()) for name in self.encoding.scalars)
        if self.skip:
            shapes["W_skip"] = (d_out, d_in)
        if cfg is not None:  # built on the meta device: shapes only, no memory
            for prefix, module in self.encoding.submodules(cfg, device="meta").items():
                shapes.update((f"{prefix}.{name}", tuple(param.shape)) for name, param in module.named_parameters())
        return shapes


def rows(encoding: Encoding, name: str, transcoder: Optional[str] = None,
         skip_transcoder: Optional[str] = None) -> tuple[ArchitectureSpec, ...]:
    """The rows of one encoding: the SAE ``name`` and, where SAELens saves them, its transcoder and skip transcoder.

    Example:
        >>> from workbench.sae.architectures.standard import ReLU
        >>> [(spec.name, spec.transcoder, spec.skip) for spec in rows(ReLU(), "standard", "transcoder")]
        [('standard', False, False), ('transcoder', True, False)]
    """
    found = [ArchitectureSpec(name, encoding)]
    if transcoder is not None:
        found.append(ArchitectureSpec(transcoder, encoding, transcoder=True))
    if skip_transcoder is not None:
        found.append(ArchitectureSpec(skip_transcoder, encoding, transcoder=True, skip=True))
    return tuple(found)


class TrainingForm:
    """An architecture's training form (SAELens's ``XTrainingSAE`` beside its ``XSAE``): what training adds to
    the generic trainer, which holds a ``wb.SAE``'s parameters (or a cross-layer set of them) and calls these.

    ``state`` is the form's own tensors (``new_state``: JumpReLU's log-threshold, batch-top-k's running threshold)
    of the dictionary, or of one layer of a cross-layer transcoder, whose state has the layers as a first axis.
    ``options`` are ``TrainSAEConfig``'s coefficients by name (``k``, ``l1_coefficient``, ...)."""

    name: ClassVar[str]
    # What the trained dictionary is saved as: an SAE, a transcoder, a skip transcoder (None: no such format).
    saved_as: ClassVar[tuple[Optional[str], Optional[str], Optional[str]]]
    # Whether pre-activations are scaled by the decoder norms (SAELens's ``rescale_acts_by_decoder_norm``).
    rescales: ClassVar[bool] = False
    # The ``TrainSAEConfig`` field that warms the sparsity coefficient up (None: no sparsity coefficient).
    warm_up: ClassVar[Optional[str]] = None
    # Whether the activation couples a batch's rows (batch-top-k: the k * N largest of the batch), so the batch
    # cannot be split over processes.
    couples_rows: ClassVar[bool] = False
    # How the form reads ``k``: None (it has no k), "integer" (exactly k features per row, top-k) or "mean" (k on
    # average over a batch's rows, batch-top-k: a fraction is allowed). The trainer's checks read it.
    k_kind: ClassVar[Optional[str]] = None

    def saved_name(self, transcoder: bool, skip: bool) -> Optional[str]:
        """The architecture the trained dictionary is saved as (None: none of SAELens's formats holds it)."""
        return self.saved_as[(2 if skip else 1) if transcoder else 0]

    def new_state(self, layers: tuple[int, ...], d_sae: int, options: Mapping[str, Any]) -> dict[str, Tensor]:
        """The form's own tensors, initialised, with ``layers`` leading axes; an ``nn.Parameter`` is trained, any
        other tensor is a buffer."""
        return {}

    def add_state(self, module: nn.Module, layers: tuple[int, ...], d_sae: int, options: Mapping[str, Any],
                  ) -> tuple[str, ...]:
        """Registers ``new_state``'s tensors on ``module`` (an ``nn.Parameter`` as a parameter, any other tensor
        as a buffer); returns their names.

        Example:
            >>> from workbench.sae.architectures import training_form
            >>> module = nn.Module()
            >>> training_form("jumprelu").add_state(module, (2,), 3, {"jumprelu_init_threshold": 0.5})
            ('log_threshold',)
            >>> module.log_threshold.shape, round(float(module.log_threshold.detach().exp()[0, 0]), 3)
            (torch.Size([2, 3]), 0.5)
        """
        state = self.new_state(layers, d_sae, options)
        for name, tensor in state.items():
            if isinstance(tensor, nn.Parameter):
                module.register_parameter(name, tensor)
            else:
                module.register_buffer(name, tensor)
        return tuple(state)

    def encode(self, sae: nn.Module, x: Float[Tensor, "N i"], state: Mapping[str, Tensor], options: Mapping[str, Any],
               rescale: bool) -> tuple[Float[Tensor, "N X"], Float[Tensor, "N X"]]:
        """(feature activations, pre-activations) of ``x`` (already centred) by ``sae``'s encoder: SAELens's
        ``encode_with_hidden_pre``; with ``rescale`` the pre-activations are times the decoder norms."""
        hidden_pre = pre_activations(sae, x)
        if rescale:
            hidden_pre = hidden_pre * sae.W_dec.norm(dim=-1)
        return self.activate(hidden_pre, state, options), hidden_pre

    def activate(self, hidden_pre: Float[Tensor, "N X"], state: Mapping[str, Tensor],
                 options: Mapping[str, Any]) -> Float[Tensor, "N X"]:
        """The training activation (with its straight-through estimator where it has one)."""
        raise NotImplementedError(f"{type(self).__name__} defines no activate")

    def sparse_features(self, hidden_pre: Float[Tensor, "N X"], options: Mapping[str, Any],
                        ) -> Optional[tuple[Tensor, Tensor]]:
        """(indices, values) of the active features when at most a few per row are (decoded sparsely), else None."""
        return None

    def sparsity_loss(self, acts: Float[Tensor, "N ... X"], hidden_pre: Float[Tensor, "N ... X"],
                      state: Mapping[str, Tensor], decoder_norms: Float[Tensor, "... X"], options: Mapping[str, Any],
                      coefficient_scale: float) -> dict[str, Tensor]:
        """The sparsity term(s) by name, summed over every feature axis and averaged over rows."""
        return {}

    def auxiliary_loss(self, hidden_pre: Float[Tensor, "N X"], residual: Float[Tensor, "N o"], dead: Tensor,
                       decode_sparse: SparseDecode, options: Mapping[str, Any]) -> dict[str, Tensor]:
        """Auxiliary term(s) by name (top-k's aux-k loss on the dead features); ``residual`` is ``target - out``."""
        return {}

    def nested_losses(self, acts: Float[Tensor, "N X"], hidden_pre: Float[Tensor, "N X"], target: Float[Tensor, "N o"],
                      dead: Tensor, W_dec: Float[Tensor, "X o"], b_dec: Float[Tensor, "o"], decode_sparse: SparseDecode,
                      options: Mapping[str, Any], rescale: bool) -> dict[str, Tensor]:
        """Term(s) of parts of the dictionary by name (Matryoshka's prefix reconstructions, and its per-level aux-k
        loss on the ``dead`` features with ``decode_sparse`` as ``auxiliary_loss`` has it); ``rescale``: the
        activations are to be divided by the decoder norms before decoding, as the whole decode does."""
        return {}

    def after_batch(self, acts: Float[Tensor, "N X"], state: Mapping[str, Tensor], options: Mapping[str, Any]) -> None:
        """Updates the state from a batch's activations (batch-top-k's running threshold)."""

    def inference_tensors(self, state: Mapping[str, Tensor], d_sae: int) -> dict[str, Tensor]:
        """The tensors the saved architecture stores that the state provides (a JumpReLU threshold)."""
        return {}

    def inference_config(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The saved architecture's own ``SAEConfig`` fields (top-k's ``k``)."""
        return {}
