"""The tokenizer side of the ``Decoder``: text <-> token ids, checked as the model needs them.

Legend: B batch, P position.

A mixin of ``workbench.model.Decoder`` (it reads ``self.cfg`` and ``self.tokenizer``), kept apart
so the model file holds the network and this one the TransformerLens-style token helpers.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from jaxtyping import Int
from torch import Tensor

from workbench.errors import InputError
from workbench.tokenizer import Tokenizer

TextOrTokens = Union[str, list[str], Int[Tensor, "batch pos"], Int[Tensor, "pos"]]


class TokenMethods:
    """``as_tokens``, ``to_tokens``, ``to_str_tokens``, ``to_string``, ``to_single_token`` for a model with ``cfg`` and ``tokenizer``."""

    def as_tokens(self, input: TextOrTokens, prepend_bos: Optional[bool] = None, offset: int = 0) -> Int[Tensor, "batch pos"]:
        """Token ids [batch, pos] on the model's device from text, a list of texts, or ids ([pos] or [batch, pos]).

        Checked: integer dtype, non-empty, every id in the vocabulary, ``offset + pos`` within n_ctx
        (``offset``: positions already in a KV cache). The one place inputs are validated.

        Example:
            >>> model.as_tokens(torch.tensor([1, 2, 3])).shape   # doctest: +SKIP
            torch.Size([1, 3])
        """
        if isinstance(input, (str, list)):
            tokens = self.to_tokens(input, prepend_bos=prepend_bos)
        elif isinstance(input, Tensor):
            tokens = input
        else:
            raise InputError(f"expected text or a tensor of token ids, got {type(input).__name__}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise InputError(f"token ids must be an integer tensor, got dtype {tokens.dtype}")
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2:
            raise InputError(f"token ids must be [batch, pos] or [pos], got shape {tuple(tokens.shape)}")
        if tokens.numel() == 0:
            raise InputError(f"empty input: token ids have shape {tuple(tokens.shape)}")
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.cfg.d_vocab:
            bad = low if low < 0 else high
            raise InputError(f"token id {bad} is out of range for a vocabulary of {self.cfg.d_vocab} (0..{self.cfg.d_vocab - 1})")
        if offset + tokens.shape[1] > self.cfg.n_ctx:
            raise InputError(
                f"sequence of {offset + tokens.shape[1]} tokens is longer than the model's context "
                f"(n_ctx={self.cfg.n_ctx})")
        return tokens.to(self.cfg.device)

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer: pass token ids instead of text")
        return self.tokenizer

    def to_tokens(self, text: Union[str, list[str]], prepend_bos: Optional[bool] = None) -> Int[Tensor, "batch pos"]:
        """Text -> token ids [batch, pos] on the model's device (BOS per the model's tokenizer).

        Example:
            >>> model.to_tokens("Hello world").shape   # doctest: +SKIP
            torch.Size([1, 2])
        """
        return self._require_tokenizer().to_tokens(text, prepend_bos).to(self.cfg.device)

    def to_str_tokens(self, input: TextOrTokens, prepend_bos: Optional[bool] = None) -> list[str]:
        """Each token of one text (or one row of ids) as its own string."""
        tok = self._require_tokenizer()
        if isinstance(input, str):
            input = tok.to_tokens(input, prepend_bos)
        if isinstance(input, Tensor):
            if input.ndim == 2:
                if input.shape[0] != 1:
                    raise InputError(f"to_str_tokens takes one sequence, got a batch of {input.shape[0]}")
                input = input[0]
            input = input.tolist()
        return tok.to_str_tokens(input)

    def to_string(self, tokens: Union[Int[Tensor, "pos"], Int[Tensor, "batch pos"], list[int]]) -> Union[str, list[str]]:
        """Token ids -> text (a list of texts for a batch)."""
        tok = self._require_tokenizer()
        if isinstance(tokens, Tensor) and tokens.ndim == 2:
            return [tok.decode(row) for row in tokens]
        return tok.decode(tokens)

    def to_single_token(self, text: str) -> int:
        """The id of a string that is exactly one token; an error otherwise."""
        ids = self._require_tokenizer().encode(text, prepend_bos=False)
        if len(ids) != 1:
            raise InputError(f"{text!r} is {len(ids)} tokens, not one")
        return ids[0]
