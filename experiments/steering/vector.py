"""``SteeringVector``: one direction per block, added (times a multiplier) to that block's output.

Legend: B batch, P position, D d_model.

The vector is attached as forward hooks on ``blocks.{l}.hook_resid_post`` through the model's own ``hooks``
context, the mechanism SAE-feature steering (``experiments.features.steering_hook``) uses, so the two compose:
concatenate their hook lists, or nest ``apply`` blocks. Everything is checked before anything is attached, so a
bad vector leaves the model as it was.

Positions follow steering-vectors: ``token_indices`` (a slice, a list of positions, or a boolean mask over the
positions) and ``min_token_index`` select among the positions a hook sees. In a generation with the KV cache a
step's hook sees only its new token, so positions count from the start only with ``use_kv_cache=False``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from experiments.steering.control_gguf import read_control_vector, write_control_vector
from experiments.steering.files import load_vector, save_vector
from workbench.errors import InputError

Hook = tuple[str, Callable[[Tensor, object], Tensor]]
TokenIndices = Union[slice, Sequence[int], Tensor, None]
LAYER_TYPE = "decoder_block"   # steering-vectors' name for a block's output


def block_output(layer: int) -> str:
    """The hook point a vector at ``layer`` reads and writes: the block's output.

    Example:
        >>> block_output(3)
        'blocks.3.hook_resid_post'
    """
    return f"blocks.{layer}.hook_resid_post"


def checked_layer(model, layer: object) -> int:
    """``layer`` as a block index of ``model`` (negative counts from the end), refused when out of range.

    Example:
        >>> checked_layer(model, -1), model.cfg.n_layers
        (1, 2)
        >>> checked_layer(model, 2)
        Traceback (most recent call last):
        workbench.errors.InputError: layer 2 is out of range: the model has 2 layers (0..1, or -2..-1)
    """
    n_layers = model.cfg.n_layers
    if isinstance(layer, bool) or not isinstance(layer, (int, torch.Tensor)) or (
            isinstance(layer, torch.Tensor) and layer.numel() != 1):
        raise InputError(f"layer must be an int, got {layer!r}")
    index = int(layer)
    if not -n_layers <= index < n_layers:
        raise InputError(f"layer {index} is out of range: the model has {n_layers} layers "
                         f"(0..{n_layers - 1}, or -{n_layers}..-1)")
    return index % n_layers


@dataclass
class SteeringVector:
    """Per-layer directions (``layer_activations``: block index -> ``[D]``) added to the blocks' outputs.

    Example:
        >>> vector = SteeringVector({0: torch.ones(128)})
        >>> clean = model(tokens)
        >>> with vector.apply(model, multiplier=0.0):
        ...     same = torch.equal(model(tokens), clean)
        >>> same, model.attached_hooks()
        (True, {})
    """

    layer_activations: dict[int, Float[Tensor, "d_model"]]
    layer_type: str = LAYER_TYPE
    meta: dict = field(default_factory=dict)   # how it was made (method, layers, read_token_index, pairs)

    def __post_init__(self) -> None:
        if not isinstance(self.layer_activations, dict) or not self.layer_activations:
            raise InputError("layer_activations must be a non-empty dict of layer -> [d_model] tensor")
        if self.layer_type != LAYER_TYPE:
            raise InputError(f"layer_type {self.layer_type!r} is not supported; only {LAYER_TYPE!r} "
                             "(the block's output, blocks.{l}.hook_resid_post)")
        sizes = set()
        for layer, direction in self.layer_activations.items():
            if not isinstance(layer, int) or isinstance(layer, bool):
                raise InputError(f"layer_activations' keys are block indices, got {layer!r}")
            if not isinstance(direction, Tensor) or direction.ndim != 1 or not direction.is_floating_point():
                raise InputError(f"layer {layer}'s direction must be a 1-D float tensor [d_model], got "
                                 f"{getattr(direction, 'shape', type(direction).__name__)}")
            if not bool(torch.isfinite(direction).all()):
                raise InputError(f"layer {layer}'s direction holds NaN or infinite values")
            sizes.add(direction.shape[0])
        if len(sizes) != 1:
            raise InputError(f"every layer's direction must have the same d_model, got sizes {sorted(sizes)}")

    @property
    def d_model(self) -> int:
        return next(iter(self.layer_activations.values())).shape[0]

    def hooks(self, model, multiplier: float = 1.0, token_indices: TokenIndices = None,
              min_token_index: Optional[int] = None) -> list[Hook]:
        """The ``(hook name, hook)`` pairs that add ``multiplier`` x each layer's direction at the chosen positions,
        checked against ``model`` (layers in range, the same d_model). Concatenate them with other steering hooks
        (``experiments.features.steering_hook``) to apply both at once.

        Example:
            >>> [name for name, _ in SteeringVector({1: torch.ones(128)}).hooks(model, 2.0)]
            ['blocks.1.hook_resid_post']
        """
        multiplier = _finite(multiplier, "multiplier")
        if self.d_model != model.cfg.d_model:
            raise InputError(f"the steering vector has d_model {self.d_model} but the model's d_model is "
                             f"{model.cfg.d_model}; it was trained on another model")
        select = _position_selector(token_indices, min_token_index)
        hooks = []
        for layer, direction in sorted(self.layer_activations.items()):
            index = checked_layer(model, layer)
            hooks.append((block_output(index), _adder(direction.detach().clone(), multiplier, select)))
        return hooks

    @contextmanager
    def apply(self, model, multiplier: float = 1.0, token_indices: TokenIndices = None,
              min_token_index: Optional[int] = None) -> Iterator[object]:
        """Steers ``model`` for the length of the block (forwards and ``generate``); the hooks go on exit, also when
        the block raises. Nested ``apply`` blocks (or one inside SAE-feature steering hooks) add up.

        Example:
            >>> vector = SteeringVector({0: torch.randn(128)})
            >>> with vector.apply(model, multiplier=4.0):
            ...     steered = model(tokens)
            >>> bool((steered - model(tokens)).abs().max() > 0), model.attached_hooks()
            (True, {})
        """
        hooks = self.hooks(model, multiplier, token_indices, min_token_index)
        with model.hooks(fwd_hooks=hooks):
            yield model

    def to(self, device=None, dtype=None) -> "SteeringVector":
        """A copy with every direction moved (steering-vectors' ``to``).

        Example:
            >>> SteeringVector({0: torch.ones(4)}).to(dtype=torch.float64).layer_activations[0].dtype
            torch.float64
        """
        return SteeringVector({layer: direction.to(device=device, dtype=dtype)
                               for layer, direction in self.layer_activations.items()}, self.layer_type, dict(self.meta))

    def save(self, folder: Union[str, Path]) -> Path:
        """Writes ``vector.safetensors`` (one tensor per layer) and ``vector.json`` into ``folder`` (see
        ``experiments.steering.files``).

        Example:
            >>> import tempfile
            >>> folder = SteeringVector({1: torch.ones(128)}, meta={"method": "caa"}).save(tempfile.mkdtemp())
            >>> SteeringVector.load(folder).layer_activations[1].sum().item()
            128.0
        """
        return save_vector(self.layer_activations, folder, self.layer_type, self.meta)

    @classmethod
    def load(cls, folder: Union[str, Path]) -> "SteeringVector":
        """The vector ``save`` wrote; a file of the wrong shape or dtype is refused (``CheckpointError``) before its
        tensors are read.

        Example:
            >>> SteeringVector.load("/nonexistent")
            Traceback (most recent call last):
            workbench.errors.CheckpointError: /nonexistent/vector.json: not found
        """
        directions, layer_type, meta = load_vector(folder)
        return cls(directions, layer_type, meta)

    def export_gguf(self, path: Union[str, Path], model_hint: str = "llama") -> Path:
        """Writes a llama.cpp control vector (repeng 0.4's GGUF: ``direction.{layer}`` tensors, ``model_hint``).

        Example:
            >>> import tempfile, os
            >>> path = SteeringVector({1: torch.ones(128)}).export_gguf(os.path.join(tempfile.mkdtemp(), "v.gguf"))
            >>> SteeringVector.import_gguf(path).layer_activations[1].shape
            torch.Size([128])
        """
        return write_control_vector(self.layer_activations, path, model_hint)

    @classmethod
    def import_gguf(cls, path: Union[str, Path]) -> "SteeringVector":
        """A llama.cpp control vector (as repeng writes it) as a ``SteeringVector``.

        Example:
            >>> SteeringVector.import_gguf("/nonexistent.gguf")
            Traceback (most recent call last):
            workbench.errors.CheckpointError: /nonexistent.gguf: not found
        """
        directions, hint = read_control_vector(path)
        return cls(directions, meta={"model_hint": hint})


def _finite(value: object, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise InputError(f"{name} must be finite, got {value!r}")
    return number


def _position_selector(token_indices: TokenIndices, min_token_index: Optional[int]) -> Callable[[int], object]:
    """A function of a hook's position count to the index that picks the steered positions (checked up front)."""
    if token_indices is not None and min_token_index is not None:
        raise InputError("give token_indices or min_token_index, not both")
    if min_token_index is not None:
        if isinstance(min_token_index, bool) or not isinstance(min_token_index, int):
            raise InputError(f"min_token_index must be an int, got {min_token_index!r}")
        return lambda n_pos: slice(min_token_index, None)
    if token_indices is None:
        return lambda n_pos: slice(None)
    if isinstance(token_indices, slice):
        return lambda n_pos: token_indices
    if isinstance(token_indices, Tensor) and token_indices.dtype == torch.bool:
        mask = token_indices.reshape(-1)

        def masked(n_pos: int) -> Tensor:   # a mask longer than the hook's positions: its last n_pos entries
            return mask[-n_pos:] if mask.shape[0] >= n_pos else torch.cat([mask, mask.new_zeros(n_pos - mask.shape[0])])
        return masked
    try:
        positions = [int(i) for i in token_indices]
    except (TypeError, ValueError):
        raise InputError("token_indices must be a slice, a list of positions or a boolean mask, got "
                         f"{token_indices!r}") from None

    def listed(n_pos: int) -> list[int]:   # positions the hook does not see are skipped, not an error
        return [i for i in positions if -n_pos <= i < n_pos]
    return listed


def _adder(direction_D: Tensor, multiplier: float, select: Callable[[int], object]) -> Callable:
    def steer(resid_BPD: Tensor, hook: object) -> Tensor:
        change_D = multiplier * direction_D.to(device=resid_BPD.device, dtype=resid_BPD.dtype)
        index = select(resid_BPD.shape[1])
        if isinstance(index, slice) and index == slice(None):
            return resid_BPD + change_D
        out = resid_BPD.clone()
        out[:, index] += change_D
        return out
    return steer
