"""A transcoder set's layers as ``wb.SAE`` transcoders, and the one converter from circuit-tracer's layout.

Legend: L n_layers, X d_sae, D d_model.

(``X`` is ``d_transcoder``, the features per layer; ``n_out`` the layers one layer's features write to.)

In memory every layer is a ``wb.SAE`` in SAELens's layout: ``W_enc [D, X]``, ``b_enc [X]``, ``threshold [X]``
(JumpReLU), ``W_dec [X, n_out * D]``, ``b_dec [n_out * D]`` and ``W_skip [D, D]`` applied as ``x @ W_skip.T`` (SAELens's and
circuit-tracer's orientation alike). A per-layer transcoder writes its own layer (``n_out = 1``); a cross-layer
transcoder's layer ``l`` writes layers ``l .. L - 1`` (``n_out = L - l``), its decoder's columns layer after layer and
``b_dec`` the written layer's bias in its first ``D`` entries (the others zero), so every layer encodes exactly as an
SAE does. circuit-tracer's layout (``W_enc [X, D]``, ``W_dec [X, n_out, D]``, ``b_dec [L, D]``) is converted here only,
for the tensor form of ``TranscoderSet(...)`` and the file readers and writers.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from workbench.errors import InputError
from workbench.sae import SAE, SAEConfig


def transcoder_sae(tensors: dict[str, Tensor], input_hook: str, output_hook: str) -> SAE:
    """A transcoder ``wb.SAE`` whose parameters are ``tensors`` themselves (SAELens's layout, shapes already
    checked; no copy, no gradient): ``W_enc``, ``b_enc``, ``W_dec`` ``[X, n_out * D]``, ``b_dec``, optional
    ``threshold`` and ``W_skip``.

    Example:
        >>> sae = transcoder_sae({"W_enc": torch.eye(2), "b_enc": torch.zeros(2), "W_dec": torch.eye(2),
        ...     "b_dec": torch.zeros(2)}, "blocks.0.ln2.hook_normalized", "blocks.0.hook_mlp_out")
        >>> sae.cfg.architecture(), sae.cfg.d_out
        ('transcoder', 2)
    """
    d_in, d_sae = tensors["W_enc"].shape
    name = ("jumprelu_" if "threshold" in tensors else "") + ("skip_" if "W_skip" in tensors else "") + "transcoder"
    cfg = SAEConfig(name, d_in=d_in, d_sae=d_sae, d_out=tensors["W_dec"].shape[1], apply_b_dec_to_input=False,
                    device="meta", metadata={"hook_name": input_hook, "hook_name_out": output_hook})
    sae = SAE(cfg)  # on the meta device: nothing allocated before its parameters are replaced
    for key, tensor in tensors.items():
        setattr(sae, key, nn.Parameter(tensor.detach(), requires_grad=False))
    sae.cfg.device, sae.cfg.dtype = str(sae.W_enc.device), str(sae.W_enc.dtype).removeprefix("torch.")
    return sae.eval()


def from_circuit_tracer_layout(W_enc: Sequence[Tensor], b_enc: Sequence[Tensor], threshold: Sequence[Optional[Tensor]],
                               W_dec: Sequence[Tensor], b_dec: Tensor, W_skip: Optional[Sequence[Tensor]],
                               hooks: Any) -> list[SAE]:
    """Each layer's transcoder from circuit-tracer's layout (``W_enc[l] [X, D]``, ``W_dec[l] [X, n_out, D]``, ``b_dec
    [L, D]``, ``W_skip[l] [D, D]``), after checking every shape and value (an ``InputError`` naming each problem).
    ``hooks(layer)`` gives (input hook, output hook).

    Example:
        >>> saes = from_circuit_tracer_layout([torch.ones(3, 2)], [torch.zeros(3)], [None], [torch.ones(3, 1, 2)],
        ...     torch.zeros(1, 2), None, lambda layer: ("blocks.0.hook_resid_mid", "blocks.0.hook_mlp_out"))
        >>> saes[0].W_enc.shape, saes[0].W_dec.shape
        (torch.Size([2, 3]), torch.Size([3, 2]))
    """
    check_circuit_tracer_layout(W_enc, b_enc, threshold, W_dec, b_dec, W_skip)
    per_layer = []
    for layer in range(len(W_enc)):
        tensors = {"W_enc": W_enc[layer].T, "b_enc": b_enc[layer], "W_dec": W_dec[layer], "b_dec": b_dec[layer]}
        if threshold[layer] is not None:
            tensors["threshold"] = threshold[layer]
        if W_skip is not None:
            tensors["W_skip"] = W_skip[layer]
        per_layer.append(tensors)
    return transcoder_layers(per_layer, hooks)


def transcoder_layers(per_layer: Sequence[dict[str, Tensor]], hooks: Any) -> list[SAE]:
    """Each layer's transcoder from its tensors in SAELens's layout, the decoder as ``W_dec [X, n_out, D]`` and ``b_dec
    [D]`` the written layer's bias; ``hooks(layer)`` gives (input hook, output hook). Shapes are the caller's to check.

    Example:
        >>> saes = transcoder_layers([{"W_enc": torch.ones(2, 3), "b_enc": torch.zeros(3), "W_dec": torch.ones(3, 2, 2),
        ...     "b_dec": torch.ones(2)}], lambda layer: ("blocks.0.hook_resid_mid", "blocks.0.hook_mlp_out"))
        >>> saes[0].W_dec.shape, saes[0].b_dec.tolist()
        (torch.Size([3, 4]), [1.0, 1.0, 0.0, 0.0])
    """
    saes = []
    for layer, tensors in enumerate(per_layer):
        n_out = tensors["W_dec"].shape[1]
        flat = {**tensors, "W_dec": tensors["W_dec"].reshape(tensors["W_dec"].shape[0], -1),
                "b_dec": _padded(tensors["b_dec"], n_out)}
        saes.append(transcoder_sae(flat, *hooks(layer)))
    return saes


def _padded(b_dec: Tensor, n_out: int) -> Tensor:
    """A layer's ``b_dec [D]`` as its transcoder's ``[n_out * D]``: the later layers' entries zero."""
    return b_dec if n_out == 1 else torch.cat([b_dec, b_dec.new_zeros((n_out - 1) * b_dec.shape[0])])


def check_circuit_tracer_layout(W_enc: Sequence[Tensor], b_enc: Sequence[Tensor], threshold: Sequence[Optional[Tensor]],
                                W_dec: Sequence[Tensor], b_dec: Tensor, W_skip: Optional[Sequence[Tensor]]) -> None:
    """Raises ``InputError`` naming every tensor of the wrong kind, shape or with NaN / infinity.

    Example:
        >>> check_circuit_tracer_layout([torch.ones(2, 3)], [torch.zeros(2)], [None], [torch.ones(2, 3)],
        ...                             torch.zeros(1, 3), None)
        Traceback (most recent call last):
        workbench.errors.InputError: TranscoderSet: W_dec[0] has shape (2, 3); expected [2, 1, 3] (per layer) or [2, 1, 3] (cross-layer)
    """
    lists = {"W_enc": W_enc, "b_enc": b_enc, "threshold": threshold, "W_dec": W_dec}
    if W_skip is not None:
        lists["W_skip"] = W_skip
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)):
            raise InputError(f"TranscoderSet: {name} must be a list of per-layer tensors, got {type(value).__name__}")
    n = len(W_enc)
    if n == 0:
        raise InputError("TranscoderSet needs at least one layer")
    for name, value in lists.items():
        if len(value) != n:
            raise InputError(f"TranscoderSet: {name} has {len(value)} layers, W_enc has {n}")
    if not isinstance(W_enc[0], Tensor) or W_enc[0].dim() != 2:
        raise InputError(f"TranscoderSet: W_enc[0] must be a [d_transcoder, d_model] tensor, got "
                         f"{getattr(W_enc[0], 'shape', type(W_enc[0]).__name__)}")
    f, d = W_enc[0].shape
    expected = {"b_dec": (b_dec, (n, d))}
    for layer in range(n):
        expected[f"W_enc[{layer}]"] = (W_enc[layer], (f, d))
        expected[f"b_enc[{layer}]"] = (b_enc[layer], (f,))
        n_out = W_dec[layer].shape[1] if isinstance(W_dec[layer], Tensor) and W_dec[layer].dim() == 3 else -1
        if n_out not in (1, n - layer):
            raise InputError(f"TranscoderSet: W_dec[{layer}] has shape {tuple(getattr(W_dec[layer], 'shape', ()))}; "
                             f"expected [{f}, 1, {d}] (per layer) or [{f}, {n - layer}, {d}] (cross-layer)")
        expected[f"W_dec[{layer}]"] = (W_dec[layer], (f, n_out, d))
        if threshold[layer] is not None:
            expected[f"threshold[{layer}]"] = (threshold[layer], (f,))
        if W_skip is not None:
            expected[f"W_skip[{layer}]"] = (W_skip[layer], (d, d))
    problems = []
    for name, (tensor, shape) in expected.items():
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            problems.append(f"{name} must be a floating-point tensor")
        elif tuple(tensor.shape) != shape:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
        elif tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):  # meta: plans
            problems.append(f"{name} holds NaN or infinity")
    if problems:
        raise InputError(f"TranscoderSet: {'; '.join(problems)}")
