"""The tokenizer side of the ``Decoder``: text <-> token ids, checked as the model needs them.

Legend: B batch, P position.

A mixin of ``workbench.model.Decoder`` (it reads ``self.cfg`` and ``self.tokenizer``), kept apart
so the model file holds the network and this one the TransformerLens-style token helpers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from workbench.errors import InputError
from workbench.tokenizer import Tokenizer
from workbench.host import DecoderHost

TextOrTokens = Union[str, list[str], Int[Tensor, "batch pos"], Int[Tensor, "pos"]]


# Typed against the host it is mixed into (workbench.host.DecoderHost); at run time a plain base.
_Host = DecoderHost if TYPE_CHECKING else object


class TokenMethods(_Host):
    """TransformerLens's token helpers (``to_tokens``, ``to_str_tokens``, ``to_string``, ``to_single_token``,
    ``to_single_str_token``, ``get_token_position``) and the checked ``as_tokens``, for a model with
    ``cfg`` and ``tokenizer``. ``prepend_bos=None`` everywhere is TransformerLens's default: BOS first
    when the tokenizer has a BOS token.

    Example:
        >>> model.to_str_tokens(model.to_tokens("import os"))
        ['<|endoftext|>', 'import', ' os']
    """

    def as_tokens(self, input: TextOrTokens, prepend_bos: Optional[bool] = None, offset: int = 0) -> Int[Tensor, "batch pos"]:
        """Token ids [batch, pos] on the model's device from text, a list of texts, or ids ([pos] or [batch, pos]).

        Checked: an integer dtype (any: cast to int64, as the embedding needs), non-empty, every id in the vocabulary, ``offset + pos`` within n_ctx
        (``offset``: positions already in a KV cache; ``cfg.context_limit`` None: no limit, dynamic
        RoPE). The one place inputs are validated.

        Example:
            >>> model.as_tokens(torch.tensor([1, 2, 3])).shape   # [pos] -> [1, pos]
            torch.Size([1, 3])
            >>> model.as_tokens("import os")
            tensor([[  0, 717, 608]])
            >>> model.as_tokens(torch.tensor([[0, 7]], dtype=torch.uint8)).dtype   # any integer dtype: int64
            torch.int64
            >>> model.as_tokens(torch.tensor([5000]))
            Traceback (most recent call last):
            workbench.errors.InputError: token id 5000 is out of range for a vocabulary of 2048 (0..2047)
        """
        if isinstance(input, (str, list)):
            tokens = self.to_tokens(input, prepend_bos=prepend_bos)
        elif isinstance(input, Tensor):
            tokens = input
        else:
            raise InputError(f"expected text or a tensor of token ids, got {type(input).__name__}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise InputError(f"tokens: token ids must be an integer tensor, got dtype {tokens.dtype}")
        tokens = tokens.long()  # any integer dtype (uint8, int32 ...) holds ids exactly; the embedding takes int64
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2:
            raise InputError(f"token ids must be [batch, pos] or [pos], got shape {tuple(tokens.shape)}")
        if tokens.numel() == 0:
            raise InputError(f"empty input: token ids have shape {tuple(tokens.shape)}")
        low, high = (0, 0) if tokens.is_meta else (int(tokens.min()), int(tokens.max()))   # meta: memory plans
        if low < 0 or high >= self.cfg.d_vocab:
            bad = low if low < 0 else high
            raise InputError(f"token id {bad} is out of range for a vocabulary of {self.cfg.d_vocab} (0..{self.cfg.d_vocab - 1})")
        if self.cfg.context_limit is not None and offset + tokens.shape[1] > self.cfg.context_limit:
            raise InputError(
                f"sequence of {offset + tokens.shape[1]} tokens is longer than the model's context "
                f"(n_ctx={self.cfg.n_ctx})")
        return tokens.to(self.cfg.device)

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer: pass token ids instead of text")
        return self.tokenizer

    def bos_first(self, prepend_bos: Optional[bool] = None) -> bool:
        """Whether tokenizing text puts BOS first: ``prepend_bos`` when given, else TransformerLens's
        default (``cfg.default_prepend_bos``, True) where the tokenizer has a BOS token.

        Example:
            >>> model.bos_first(), model.bos_first(False)
            (True, False)
        """
        if prepend_bos is not None:
            return prepend_bos
        return self.cfg.default_prepend_bos and self._require_tokenizer().bos_token_id is not None

    def to_tokens(self, text: Union[str, list[str]], prepend_bos: Optional[bool] = None,
                  padding_side: str = "right") -> Int[Tensor, "batch pos"]:
        """Text (or a list of texts, padded on ``padding_side``) -> token ids [batch, pos] on the model's device.

        Running the model on the list of texts itself (``model(texts)``) also builds the attention
        mask that keeps the pads out; with these ids pass ``attention_mask=`` (see ``to_tokens_and_mask``).

        ``prepend_bos=None`` is TransformerLens's default: BOS first when the tokenizer has one
        (``cfg.default_prepend_bos``, see ``bos_first``); ``False``/``True`` overrides it.

        Example:
            >>> model.to_tokens("import os")                     # BOS, "import", " os"
            tensor([[  0, 717, 608]])
            >>> model.to_tokens("import os", prepend_bos=False)
            tensor([[717, 608]])
        """
        return self.to_tokens_and_mask(text, prepend_bos, padding_side)[0]

    def to_tokens_and_mask(self, text: Union[str, list[str]], prepend_bos: Optional[bool] = None,
                           padding_side: str = "right") -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
        """Token ids [batch, pos] and the attention mask [batch, pos] (1 = real token, 0 = pad) of a
        text or a list of texts padded on ``padding_side`` ("right" or "left").

        Example:
            >>> tokens, mask = model.to_tokens_and_mask(["import os", "x"], padding_side="left")
            >>> tokens.tolist(), mask.tolist()   # "x" is BOS and one token: left-padded (pad id 0)
            ([[0, 717, 608], [0, 0, 88]], [[1, 1, 1], [0, 1, 1]])
            >>> model(tokens, attention_mask=mask).shape
            torch.Size([2, 3, 2048])
        """
        tokens, mask = self._require_tokenizer().to_tokens_and_mask(text, self.bos_first(prepend_bos), padding_side)
        return tokens.to(self.cfg.device), mask.to(self.cfg.device)

    def as_tokens_and_mask(self, input: TextOrTokens, prepend_bos: Optional[bool] = None, offset: int = 0,
                           attention_mask: Optional[Tensor] = None, padding_side: str = "right"
                           ) -> tuple[Int[Tensor, "batch pos"], Optional[Tensor]]:
        """``as_tokens``, and the attention mask as a bool [batch, pos] (True = real token) or None
        when nothing is padding. A list of texts builds its own mask; a given mask is checked: its
        shape must be the tokens', every row must hold a real token.

        Example:
            >>> tokens, mask = model.as_tokens_and_mask(["import os", "x"], padding_side="left")
            >>> mask
            tensor([[ True,  True,  True],
                    [False,  True,  True]])
            >>> model.as_tokens_and_mask("import os")[1] is None   # nothing is padding
            True
        """
        texts = isinstance(input, list) and input and all(isinstance(item, str) for item in input)
        if texts and attention_mask is None and len(input) > 1:
            input, attention_mask = self.to_tokens_and_mask(input, prepend_bos, padding_side)
        tokens = self.as_tokens(input, prepend_bos, offset)
        if attention_mask is None:
            return tokens, None
        return tokens, check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)

    def to_str_tokens(self, input: Union[TextOrTokens, list, int], prepend_bos: Optional[bool] = None
                      ) -> Union[list[str], list[list[str]]]:
        """Each token as its own string, as TransformerLens's ``to_str_tokens``.

        ``input``: a text (``prepend_bos`` as in ``to_tokens``), ids as a 1-D tensor or a list of
        ints, an int or a 0-d tensor (a one-element list), a [1, pos] tensor (one list, as
        TransformerLens), a [batch, pos] tensor or a list of texts / id rows (a list of lists).

        Example:
            >>> model.to_str_tokens("import os")
            ['<|endoftext|>', 'import', ' os']
            >>> model.to_str_tokens(["a b", "c"], prepend_bos=False)
            [['a', ' b'], ['c']]
            >>> model.to_str_tokens(tokens[0, :4])
            ['<|endoftext|>', 'The', ' c', 'at']
        """
        tok = self._require_tokenizer()
        if isinstance(input, str):
            return tok.to_str_tokens(tok.encode(input, self.bos_first(prepend_bos)))
        if isinstance(input, (list, tuple)) and input and all(isinstance(item, str) for item in input):
            return [self.to_str_tokens(item, prepend_bos) for item in input]
        rows, batched = _id_rows(input, "to_str_tokens")
        texts = [tok.to_str_tokens(row) for row in rows]
        return texts if batched and len(texts) > 1 else texts[0]  # a [1, pos] tensor is one sequence, as TL

    def to_string(self, tokens: Union[Int[Tensor, "pos"], Int[Tensor, "batch pos"], list, int]) -> Union[str, list[str]]:
        """Token ids -> text, as TransformerLens's ``to_string``: one string for an int, a 0-d or 1-d
        tensor or a list of ints; a list of strings for [batch, pos] (or a list of id rows).

        Example:
            >>> model.to_string(tokens[0, 1:])                # past BOS
            'The cat sat on the mat. The cat'
            >>> model.to_string(logits[0, -1].argmax())       # one id (0-d tensor): the next token, " s" of " sat"
            ' s'
        """
        rows, batched = _id_rows(tokens, "to_string")
        texts = [self._require_tokenizer().decode(row) for row in rows]
        return texts if batched else texts[0]

    def to_single_token(self, string: str) -> int:
        """The id of a string that is exactly one token (no BOS); ``InputError`` otherwise.

        Example:
            >>> model.to_single_token(" return")
            334
            >>> model.to_single_token(" cat")
            Traceback (most recent call last):
            workbench.errors.InputError: ' cat' is 2 tokens, not one: [' c', 'at']
        """
        ids = self._require_tokenizer().encode(string, prepend_bos=False)
        if len(ids) != 1:
            raise InputError(f"{string!r} is {len(ids)} tokens, not one: {self._require_tokenizer().to_str_tokens(ids)}")
        return ids[0]

    def to_single_str_token(self, int_token: int) -> str:
        """The string of one token id (the inverse of ``to_single_token``).

        Example:
            >>> model.to_single_str_token(334)
            ' return'
        """
        if not _is_int(int_token):
            raise InputError(f"to_single_str_token takes one token id (an int), got {type(int_token).__name__}")
        return self._require_tokenizer().to_str_tokens([int(int_token)])[0]

    def get_token_position(self, single_token: Union[str, int, Tensor], input: Union[str, Int[Tensor, "pos"],
                           Int[Tensor, "1 pos"], list[int]], mode: str = "first",
                           prepend_bos: Optional[bool] = None) -> int:
        """The position of ``single_token`` in ``input``, as TransformerLens's ``get_token_position``.

        Args:
            single_token: a string that is exactly one token, or a token id.
            input: a text (tokenized with ``prepend_bos``, default as ``to_tokens``, so BOS counts
                as position 0), or ids [pos] / [1, pos] / a list of ints.
            mode: "first" or "last" occurrence.

        ``InputError`` when the token does not occur in the input.

        Example:
            >>> model.get_token_position(" return", "def f(self):\\n    return self.x")   # BOS is position 0
            7
            >>> model.get_token_position(" c", tokens), model.get_token_position(" c", tokens, mode="last")
            (2, 12)
        """
        if mode not in ("first", "last"):
            raise InputError(f"mode must be 'first' or 'last', not {mode!r}")
        if isinstance(input, str):
            ids = torch.tensor(self._require_tokenizer().encode(input, self.bos_first(prepend_bos)))
        elif isinstance(input, (list, tuple)) and all(_is_int(i) for i in input):
            ids = torch.tensor([int(i) for i in input], dtype=torch.long)
        else:
            ids = _id_tensor(input, "get_token_position")
            if ids.ndim == 2:
                if ids.shape[0] != 1:
                    raise InputError(f"get_token_position takes one sequence: ids of shape [pos] or [1, pos], "
                                     f"got {tuple(ids.shape)}")
                ids = ids[0]
            elif ids.ndim != 1:
                raise InputError(f"get_token_position takes ids of shape [pos] or [1, pos], got {tuple(ids.shape)}")
        if isinstance(single_token, str):
            token_id = self.to_single_token(single_token)
        elif isinstance(single_token, Tensor) and single_token.numel() == 1:
            token_id = int(single_token.item())
        elif _is_int(single_token):
            token_id = int(single_token)
        else:
            raise InputError(f"single_token must be a one-token string or a token id, got {type(single_token).__name__}")
        positions = (ids == token_id).nonzero().flatten()
        if positions.numel() == 0:
            shown = repr(single_token) if isinstance(single_token, str) else f"id {token_id}"
            raise InputError(f"the token {shown} does not occur in the input ({ids.numel()} tokens)")
        return int(positions[0] if mode == "first" else positions[-1])


def _is_int(value: object) -> bool:
    """A Python or NumPy integer (not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _id_tensor(value: object, caller: str) -> Int[Tensor, "..."]:
    """``value`` as an integer tensor of ids (a NumPy array is converted); ``InputError`` otherwise."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, Tensor):
        raise InputError(f"{caller} takes text, token ids (a tensor, a list of ints or an int), got {type(value).__name__}")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise InputError(f"{caller}: token ids must be integers, got dtype {value.dtype}")
    return value


def _id_rows(ids: object, caller: str) -> tuple[list[list[int]], bool]:
    """Token ids in any of TransformerLens's spellings as rows of ints, and whether they came as a
    batch: an int / 0-d tensor or a [pos] tensor / list of ints is one row, a [batch, pos] tensor or
    a list of id rows is a batch."""
    if _is_int(ids):
        return [[int(ids)]], False
    if isinstance(ids, (list, tuple)):
        if all(_is_int(i) for i in ids):
            return [[int(i) for i in ids]], False
        return [row for item in ids for row in _id_rows(item, caller)[0]], True
    tensor = _id_tensor(ids, caller)
    if tensor.ndim > 2:
        raise InputError(f"{caller} takes ids of shape [], [pos] or [batch, pos], got {tuple(tensor.shape)}")
    return tensor.reshape(-1, tensor.shape[-1] if tensor.ndim else 1).tolist(), tensor.ndim == 2


def check_attention_mask(attention_mask: Tensor, shape: tuple[int, int], device: torch.device) -> Tensor:
    """``attention_mask`` ([pos] or [batch, pos], 1 = real token, 0 = pad) as a bool [batch, pos] on
    ``device``, or an ``InputError`` when its shape is not ``shape`` or it holds other values.

    Example:
        >>> check_attention_mask(torch.tensor([1, 0]), (1, 2), torch.device("cpu")).tolist()
        [[True, False]]
    """
    mask = attention_mask if attention_mask.ndim == 2 else attention_mask[None]
    if tuple(mask.shape) != tuple(shape):
        raise InputError(f"attention_mask has shape {tuple(attention_mask.shape)} but the tokens have "
                         f"{tuple(shape)}; they must match")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise InputError("attention_mask must hold only 1 (a real token) and 0 (padding)")
    return mask.to(device=device, dtype=torch.bool)
