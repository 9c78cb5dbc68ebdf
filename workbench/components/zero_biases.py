"""Biases a part lacks read as zeros of TransformerLens's shape, as in a TransformerLens model.

TransformerLens gives every attention, MLP and unembedding part all of its biases (a Llama's ``b_Q``,
``b_in`` and ``b_U`` are zero tensors), so recipes such as ``model.unembed.b_U.sort()`` run on any model.
Our parts store only the biases the checkpoint has (no parameter, no memory, no add in the forward pass);
this mixin makes reading an absent one (``unembed.b_U``, ``mlp.b_in``, ``attn.b_O``) return a fresh zero
tensor of TransformerLens's shape on the part's device and dtype. Writing into that tensor changes nothing:
assign an ``nn.Parameter`` to give the part a real bias.

The forward passes read ``stored_bias(name)`` (the parameter or None), never the zeros.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn


class ZeroBiases:
    """Mixin for an ``nn.Module``: each name in ``self.bias_shapes`` ({name: shape}, set before the biases)
    is a parameter or absent; read while absent it is zeros of that shape.

    Example:
        >>> attn = model.blocks[0].attn   # toy-attn-2l has no attention biases
        >>> attn.stored_bias("b_O") is None, attn.b_O.shape, bool(attn.b_O.any())
        (True, torch.Size([128]), False)
    """

    bias_shapes: dict[str, tuple[int, ...]]

    def __setattr__(self, name: str, value: Any) -> None:
        if value is None and name in self.__dict__.get("bias_shapes", ()):
            # Registered as an absent parameter, so reads come to __getattr__ (and state_dict skips it).
            nn.Module.register_parameter(self, name, None)
            return
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        if value is None and name in self.__dict__.get("bias_shapes", ()):
            like = self._like()
            return torch.zeros(self.bias_shapes[name], dtype=like.dtype, device=like.device)
        return value

    def stored_bias(self, name: str) -> Optional[Tensor]:
        """The bias parameter ``name``, or None when the part has none (what the forward pass adds)."""
        return self._parameters.get(name)

    def _like(self) -> Tensor:
        """A weight of this part, whose dtype and device the zeros take."""
        for param in self._parameters.values():
            if param is not None:
                return param
        raise AttributeError("a part with no parameters has no bias to read as zeros")
